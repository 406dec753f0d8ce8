"""Grouped GEMM, cuTile backend (cuda.tile): the three products training needs, each one launch
over all groups, the groups' operands passed as lists of arrays (cuTile list parameters, indexed
on the device by the program's group: no stacking copies, like the Triton kernel's address table):

    forward   c_g  = a_g @ b_g        items (group, row tile of c_g),  grid (items, N / BN)
    d a       da_g = dc_g @ b_g^T     items (group, row tile of da_g), grid (items, K / BN)
    d b       db_g = a_g^T @ dc_g     items (group, row tile of db_g), grid (items, N / BN);
                                      the reduction runs over the group's M_g rows (none for an
                                      empty group: db_g = 0)

Outputs are views of one stacked buffer (c, da: [sum M_i, ...]; db: [G, K, N]), passed as lists
too. Transposed operands (b^T, a^T) are loaded as tiles of their row-major storage and
transposed in registers; loads pad with zeros past an array's end. 16-bit inputs only: fp32
products must be full fp32 in this op (no tf32), and what cuTile's mma does with fp32 tiles on
Hopper is not established here. cuTile chooses the MMA instructions (WGMMA on sm_90), the
pipelining and TMA use.
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from tileport.cutile_support import CutileCompileCase, array_spec, launch, list_spec, scalar_spec
from tileport.memory import device_table, new_empty
from tileport.shapes import cdiv

BM, BN, BK = 128, 128, 64
ZERO = ct.PaddingMode.ZERO
SUPPORTED = (torch.bfloat16, torch.float16)


def cutile_refusal(dtype, b_dtype) -> str | None:
    if dtype not in SUPPORTED or b_dtype != dtype:
        return (f"the cuTile grouped GEMM takes bfloat16 or float16 a and b of one dtype (got {dtype}, {b_dtype}): "
                "fp32 must multiply in full fp32 here, not established for cuTile's mma")
    return None


@ct.kernel
def _grouped_gemm_kernel(xs, ws, outs, items, n_red: int, BM: ct.Constant[int], BN: ct.Constant[int],
                         BK: ct.Constant[int], MODE: ct.Constant[int]):
    """One [BM, BN] tile of one group's output; grid (items, column tiles). MODE 0: out_g = x_g @
    w_g (forward: x = a, w = b); MODE 1: out_g = x_g @ w_g^T (d a: x = dc, w = b); MODE 2: out_g =
    x_g^T @ w_g over the group's rows (d b: x = a, w = dc). n_red: the reduction length of modes
    0 and 1 (K, N)."""
    item = ct.bid(0)
    nt = ct.bid(1)
    g = ct.load(items, index=(item, 0), shape=())
    rt = ct.load(items, index=(item, 1), shape=())
    xg = xs[g]
    wg = ws[g]
    og = outs[g]
    acc = ct.zeros((BM, BN), dtype=ct.float32)
    if MODE == 2:
        for mt in range(ct.cdiv(xg.shape[0], BK)):
            xt = ct.transpose(ct.load(xg, index=(mt, rt), shape=(BK, BM), padding_mode=ZERO))
            wt = ct.load(wg, index=(mt, nt), shape=(BK, BN), padding_mode=ZERO)
            acc = ct.mma(xt, wt, acc)
    else:
        for kt in range(ct.cdiv(n_red, BK)):
            xt = ct.load(xg, index=(rt, kt), shape=(BM, BK), padding_mode=ZERO)
            if MODE == 0:
                wt = ct.load(wg, index=(kt, nt), shape=(BK, BN), padding_mode=ZERO)
            else:
                wt = ct.transpose(ct.load(wg, index=(nt, kt), shape=(BN, BK), padding_mode=ZERO))
            acc = ct.mma(xt, wt, acc)
    ct.store(og, index=(rt, nt), tile=acc.astype(og.dtype))


# ----------------------------------------------------------------------------------------
# stages
# ----------------------------------------------------------------------------------------
def _items(rows_per_group: list[int], device) -> tuple[torch.Tensor, int]:
    """[n, 2] int32 (group, row tile of its output, BM rows each) on the device (a placeholder
    row when n = 0), and n."""
    items = [(g, t) for g, r in enumerate(rows_per_group) for t in range(cdiv(r, BM))]
    return device_table(items or [(0, 0)], torch.int32, device), len(items)


def grouped_gemm_forward_cutile(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """c stacked [sum M_i, N] (groups in order). a_i [M_i, K], b_i [K, N] contiguous."""
    K, N = b[0].shape
    Ms = [x.shape[0] for x in a]
    c = new_empty((sum(Ms), N), a[0].dtype, a[0].device)
    items, n = _items(Ms, c.device)
    if n:
        launch(_grouped_gemm_kernel, (n, cdiv(N, BN)), (list(a), list(b), list(c.split(Ms)), items, K, BM, BN, BK, 0))
    return c


def grouped_gemm_backward_cutile(grad_c: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor],
                                 want_da: bool, want_db: bool):
    """(da stacked [sum M_i, K] or None, db [G, K, N] or None) from grad_c [sum M_i, N]."""
    K, N = b[0].shape
    Ms = [x.shape[0] for x in a]
    G = len(a)
    dcs = list(grad_c.contiguous().split(Ms))
    da = db = None
    if want_da:
        da = new_empty((sum(Ms), K), grad_c.dtype, grad_c.device)
        items, n = _items(Ms, da.device)
        if n:
            launch(_grouped_gemm_kernel, (n, cdiv(K, BN)), (dcs, list(b), list(da.split(Ms)), items, N, BM, BN, BK, 1))
    if want_db:
        db = new_empty((G, K, N), grad_c.dtype, grad_c.device)
        items, n = _items([K] * G, db.device)
        launch(_grouped_gemm_kernel, (n, cdiv(N, BN)), (list(a), dcs, list(db.unbind(0)), items, 0, BM, BN, BK, 2))
    return da, db


def compile_cases() -> list[CutileCompileCase]:
    x = list_spec(array_spec("bfloat16", 2))
    return [CutileCompileCase(f"grouped_gemm {name} bfloat16", _grouped_gemm_kernel,
                              [x, x, x, array_spec("int32", 2), scalar_spec("int32"), BM, BN, BK, mode])
            for mode, name in ((0, "fwd"), (1, "d a"), (2, "d b"))]
