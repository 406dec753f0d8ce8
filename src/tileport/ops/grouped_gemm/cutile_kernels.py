"""Grouped GEMM, cuTile backend (cuda.tile): the three products training needs, each one launch
over all groups, with the groups' rows as slices of one stacked operand:

    forward   c_g  = a_g @ b_g        items (group, row tile of c_g),  grid (items, N / BN)
    d a       da_g = dc_g @ b_g^T     items (group, row tile of da_g), grid (items, K / BN)
    d b       db_g = a_g^T @ dc_g     items (group, row tile of db_g), grid (items, N / BN);
                                      the reduction runs over the group's M_g rows (0 for an
                                      empty group: db_g = 0)

a and dc are [sum M_i, K or N] stacked (groups in order; `offsets` [G + 1] int32 on the device);
b is [G, K, N]. A program slices its group's rows out of the stacked arrays (`Array.slice`, bounds
from `offsets`), so a row tile never crosses into the next group and cuTile's loads pad with zeros
past the group's end. Transposed operands (b^T, a^T) are loaded as tiles of their row-major
storage and transposed in registers. 16-bit inputs only: fp32 products must be full fp32 in
this op (no tf32), and what cuTile's mma does with fp32 tiles on Hopper is not established here.
cuTile chooses the MMA instructions (WGMMA on sm_90), the pipelining and TMA use.
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from tileport.cutile_support import CutileCompileCase, array_spec, launch, scalar_spec
from tileport.memory import new_empty

BM, BN, BK = 128, 128, 64
ZERO = ct.PaddingMode.ZERO
SUPPORTED = (torch.bfloat16, torch.float16)


def cutile_refusal(dtype, b_dtype) -> str | None:
    if dtype not in SUPPORTED or b_dtype != dtype:
        return (f"the cuTile grouped GEMM takes bfloat16 or float16 a and b of one dtype (got {dtype}, {b_dtype}): "
                "fp32 must multiply in full fp32 here, not established for cuTile's mma")
    return None


@ct.kernel
def _grouped_gemm_kernel(x, w, out, offsets, items, n_red: int, BM: ct.Constant[int], BN: ct.Constant[int],
                         BK: ct.Constant[int], MODE: ct.Constant[int]):
    """One tile [BM, BN] of one group's output; grid (items, column tiles). MODE 0: out_g = x_g
    @ w_g (forward: x = a, w = b; d a: x = dc, w = b read as b_g^T); MODE 1 is d a; MODE 2: out_g
    = x_g^T @ w_g with x = a, w = dc over the group's rows (d b, out [G, K, N]). n_red: the
    reduction length (K forward, N for d a; unused for d b, whose length is the group's M_g)."""
    item = ct.bid(0)
    nt = ct.bid(1)
    g = ct.load(items, index=(item, 0), shape=())
    rt = ct.load(items, index=(item, 1), shape=())
    start = ct.load(offsets, index=(g,), shape=())
    stop = ct.load(offsets, index=(g + 1,), shape=())
    acc = ct.zeros((BM, BN), dtype=ct.float32)
    if MODE == 2:
        for mt in range(ct.cdiv(stop - start, BK)):
            xg = x.slice(0, start, stop)
            wg = w.slice(0, start, stop)
            xt = ct.transpose(ct.load(xg, index=(mt, rt), shape=(BK, BM), padding_mode=ZERO))
            wt = ct.load(wg, index=(mt, nt), shape=(BK, BN), padding_mode=ZERO)
            acc = ct.mma(xt, wt, acc)
        ct.store(out, index=(g, rt, nt), tile=ct.reshape(acc.astype(out.dtype), (1, BM, BN)))
    else:
        xg = x.slice(0, start, stop)
        og = out.slice(0, start, stop)
        for kt in range(ct.cdiv(n_red, BK)):
            xt = ct.load(xg, index=(rt, kt), shape=(BM, BK), padding_mode=ZERO)
            if MODE == 0:
                wt = ct.reshape(ct.load(w, index=(g, kt, nt), shape=(1, BK, BN), padding_mode=ZERO), (BK, BN))
            else:
                wt = ct.transpose(ct.reshape(ct.load(w, index=(g, nt, kt), shape=(1, BN, BK), padding_mode=ZERO),
                                             (BN, BK)))
            acc = ct.mma(xt, wt, acc)
        ct.store(og, index=(rt, nt), tile=acc.astype(out.dtype))


# ----------------------------------------------------------------------------------------
# stages
# ----------------------------------------------------------------------------------------
def _stacked(parts: list[torch.Tensor], rows: int) -> torch.Tensor:
    """The [M_i, K] parts as one [rows, K] tensor: a view when they already sit back to back in
    one buffer (grouped_gemm_stacked's a, a MoE layer's token buffer), else a copy."""
    filled = [p for p in parts if p.numel()]  # an empty tensor's data_ptr() is 0, not its place
    if not filled:
        return torch.cat(parts)
    first = filled[0]
    e, ptr, storage = first.element_size(), first.data_ptr(), first.untyped_storage().data_ptr()
    back_to_back = True
    for p in filled:
        back_to_back = (back_to_back and p.is_contiguous() and p.data_ptr() == ptr
                        and p.untyped_storage().data_ptr() == storage)
        ptr += p.numel() * e
    if back_to_back:
        return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))
    return torch.cat(parts)


def _tables(Ms: list[int], rows_per_group: list[int], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """offsets [G + 1] (group starts in the stacked rows) and items [n, 2] (group, row tile of
    its output, BM rows each; a placeholder row when n = 0), int32 on the device; and n."""
    offs = [0]
    for m in Ms:
        offs.append(offs[-1] + m)
    items = [(g, t) for g, r in enumerate(rows_per_group) for t in range(-(-r // BM))]
    offsets = torch.tensor(offs, dtype=torch.int32).to(device)
    return offsets, torch.tensor(items or [(0, 0)], dtype=torch.int32).to(device), len(items)


def grouped_gemm_forward_cutile(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """c stacked [sum M_i, N] (groups in order). a_i [M_i, K], b_i [K, N]."""
    K, N = b[0].shape
    Ms = [x.shape[0] for x in a]
    S = sum(Ms)
    c = new_empty((S, N), a[0].dtype, a[0].device)
    offsets, items, n = _tables(Ms, Ms, c.device)
    if n:
        launch(_grouped_gemm_kernel, (n, -(-N // BN)),
               (_stacked(a, S), torch.stack(b), c, offsets, items, K, BM, BN, BK, 0))
    return c


def grouped_gemm_backward_cutile(grad_c: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor],
                                 want_da: bool, want_db: bool):
    """(da stacked [sum M_i, K] or None, db [G, K, N] or None) from grad_c [sum M_i, N]."""
    K, N = b[0].shape
    Ms = [x.shape[0] for x in a]
    S, G = sum(Ms), len(a)
    dc = grad_c.contiguous()
    da = db = None
    if want_da:
        da = new_empty((S, K), grad_c.dtype, grad_c.device)
        offsets, items, n = _tables(Ms, Ms, da.device)
        if n:
            launch(_grouped_gemm_kernel, (n, -(-K // BN)), (dc, torch.stack(b), da, offsets, items, N, BM, BN, BK, 1))
    if want_db:
        db = new_empty((G, K, N), grad_c.dtype, grad_c.device)
        offsets, items, n = _tables(Ms, [K] * G, db.device)
        launch(_grouped_gemm_kernel, (n, -(-N // BN)), (_stacked(a, S), dc, db, offsets, items, 0, BM, BN, BK, 2))
    return da, db


def compile_cases() -> list[CutileCompileCase]:
    cases = []
    for mode, name in ((0, "fwd"), (1, "d a"), (2, "d b")):
        x, w3 = array_spec("bfloat16", 2), array_spec("bfloat16", 3)
        w = w3 if mode < 2 else x
        out = x if mode < 2 else w3
        cases.append(CutileCompileCase(f"grouped_gemm {name} bfloat16", _grouped_gemm_kernel,
                                       [x, w, out, array_spec("int32", 1), array_spec("int32", 2), scalar_spec("int32"),
                                        BM, BN, BK, mode]))
    return cases
