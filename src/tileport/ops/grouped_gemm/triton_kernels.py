"""Grouped GEMM, Triton backend: one launch per direction, all groups in one grid.

One kernel computes G independent products C_g [M_g, Np] = A_g [M_g, K_g] @ B_g [K_g, Np]
(fp32 accumulation) whose operands are addressed through scalar strides shared by the groups and
a per-group table on the device: (a, b, c base addresses, M_g, K_g). The three products training
needs are all of that form:
    forward   c_i  = a_i @ b_i        M_g = M_i, K_g = K,   Np = N
    d a       da_i = dc_i @ b_i^T     M_g = M_i, K_g = N,   Np = K     (b_i^T read through strides)
    d b       db_i = a_i^T @ dc_i     M_g = K,   K_g = M_i, Np = N     (a_i^T read through strides)
A second table lists the (group, row tile) pairs, so the grid is (row tiles of all groups,
column tiles) with no empty programs; a group with M_i = 0 has no row tile in the forward and
writes a zero db (an empty reduction).

Tensor descriptors (TMA on sm_90) are made per program from the group's base address when the
rows of a_i, b_i and c_i are 16-byte aligned (K and N multiples of 8 for 16-bit types); a
transposed operand is read as tiles of its row-major storage and transposed in registers
(A_T / B_T). Otherwise masked raw pointers. fp32 inputs multiply in full fp32 ("ieee"),
16-bit inputs on the tensor cores (under the interpreter bf16 operands are widened to fp32
first: its bf16 tl.dot is wrong in triton 3.6, and its fp32 -> bf16 cast truncates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileport.autotuning import tuned
from tileport.devices import capability
from tileport.dispatch import interpreter_enabled
from tileport.shapes import cdiv, next_pow2
from tileport.memory import device_table, new_empty
from tileport.triton_rows import _interpreting, ensure_descriptor_allocator

# The row tile and the band are fixed on the host (the tile table is built from BM); the column
# tile, the depth of a K step and the pipeline are autotuned on the card (`GEMM_OPTIONS`, first
# one: the form the H200 bench timed at 14963d1, 1.070 ms forward at G=8 M=2048 K=N=4096 against
# torch's loop of matmuls at 0.844). Shared memory per candidate: stages x (BM + BN) x BK
# elements (the output tile reuses it; ptxas's figure, checked in tests/test_triton_compile.py),
# under sm_90's 227 KB per CTA: every candidate in 16 bits, only the first in fp32
# (`candidate_fits`; the autotuner never compiles the others for fp32).
_GPU_BLOCKS = dict(BM=128, BAND=8)
_INTERPRETER_BLOCKS = dict(BM=64, BAND=2)  # BAND 2: bands and a ragged last band in small tests
GEMM_OPTIONS = (
    dict(BN=128, BK=64, num_warps=8, num_stages=3),   # 96 + 32 KB
    dict(BN=128, BK=64, num_warps=8, num_stages=4),   # 128 + 32 KB
    dict(BN=256, BK=64, num_warps=8, num_stages=3),   # 144 + 64 KB: half as many reads of A
    dict(BN=128, BK=128, num_warps=8, num_stages=3),  # 192 + 32 KB: half as many K steps
)
INTERPRETER_GEMM_OPTIONS = (dict(BN=64, BK=64, num_warps=4, num_stages=1),)
_SHARED_MEMORY_LIMIT = 227 * 1024  # bytes per CTA on sm_90


def candidate_fits(option: dict, element_size: int, BM: int | None = None) -> bool:
    """Whether a candidate's operand pipeline fits one CTA's shared memory on sm_90."""
    BM = BM or _GPU_BLOCKS["BM"]
    return option["num_stages"] * (BM + option["BN"]) * option["BK"] * element_size <= _SHARED_MEMORY_LIMIT


def _prune_to_fitting(configs, named_args, **kwargs):
    """The autotuner's candidates that fit for this call's element size (at least the first)."""
    size = named_args["like_ptr"].element_size()
    kept = [c for c in configs if candidate_fits(dict(c.kwargs, num_stages=c.num_stages), size, kwargs.get("BM"))]
    return kept or configs[:1]
_PREFER_DESCRIPTORS = True
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def gemm_config(device: torch.device) -> dict:
    return dict(_INTERPRETER_BLOCKS if _interpreting(device) else _GPU_BLOCKS)


def triton_refusal(dtype, b_dtype) -> str | None:
    if dtype not in _SUPPORTED_DTYPES:
        return f"dtype {dtype} is not one of float32, float16, bfloat16"
    if b_dtype != dtype:
        return f"b dtype {b_dtype} differs from a dtype {dtype}"
    return None


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b. UPCAST (bf16 under the interpreter, whose bf16 tl.dot is wrong in triton 3.6):
    the operands go in as fp32, exactly, and multiply in full fp32."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.autotune(configs=tuned(INTERPRETER_GEMM_OPTIONS if interpreter_enabled() else GEMM_OPTIONS),
                 key=["Np", "ROWS_BUCKET", "K_BUCKET", "USE_DESC", "IEEE", "A_T", "B_T"],
                 prune_configs_by={"early_config_prune": _prune_to_fitting})
@triton.jit(do_not_specialize=["ROWS_BUCKET", "K_BUCKET"])
def _grouped_gemm_kernel(
    table_ptr, tiles_ptr, like_ptr, Np, n_row_tiles, ROWS_BUCKET, K_BUCKET, sam, sak, sbk, sbn, scm,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_DESC: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr, BAND: tl.constexpr,
):
    """C tile (row tile r of the tile table, column tile c) of one group's product; grid
    (row tiles x column tiles,), 1D; BN, BK and the pipeline autotuned (ROWS_BUCKET, K_BUCKET: the
    row tiles and the largest K_g, rounded up to powers of two, are only the tuning key, so new
    group sizes of one workload do not tune again). Explicit here: the order of the tiles. Programs run in bands
    of BAND row tiles, and within a band every column tile is visited for all of the band's rows
    before the next column tile, so a band's A tiles (BAND x BM x K) stay in L2 while its group's B
    is read once per band. In the plain 2D grid (row tiles fastest) one wave of programs covered
    one column tile of every group: all of A was read again for each column tile (at G=8,
    M=2048, K=N=4096: 32 x 128 MB = 4 GB, ~0.85 ms of HBM traffic next to ~0.8 ms of tensor-core
    work; the H200 bench at f7de67f measured 1.25 ms)."""
    pid = tl.program_id(0)
    n_col_tiles = tl.cdiv(Np, BN)
    per_band = BAND * n_col_tiles
    first = (pid // per_band) * BAND
    rows_here = tl.minimum(n_row_tiles - first, BAND)
    r = first + (pid % per_band) % rows_here
    n0 = ((pid % per_band) // rows_here) * BN
    g = tl.load(tiles_ptr + 2 * r)
    m0 = tl.load(tiles_ptr + 2 * r + 1) * BM
    ety = like_ptr.dtype.element_ty
    a_ptr = tl.load(table_ptr + 5 * g).to(tl.pointer_type(ety))
    b_ptr = tl.load(table_ptr + 5 * g + 1).to(tl.pointer_type(ety))
    c_ptr = tl.load(table_ptr + 5 * g + 2).to(tl.pointer_type(ety))
    Mg = tl.load(table_ptr + 5 * g + 3).to(tl.int32)
    Kg = tl.load(table_ptr + 5 * g + 4).to(tl.int32)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if USE_DESC:
        # A_T / B_T: the operand is the transpose of a row-major matrix (its storage), read as
        # storage tiles and transposed in registers.
        if A_T:
            a_desc = tl.make_tensor_descriptor(a_ptr, shape=[Kg, Mg], strides=[sak, 1], block_shape=[BK, BM])
        else:
            a_desc = tl.make_tensor_descriptor(a_ptr, shape=[Mg, Kg], strides=[sam, 1], block_shape=[BM, BK])
        if B_T:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[Np, Kg], strides=[sbn, 1], block_shape=[BN, BK])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[Kg, Np], strides=[sbk, 1], block_shape=[BK, BN])
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[Mg, Np], strides=[scm, 1], block_shape=[BM, BN])
        for k in range(0, Kg, BK):
            if A_T:
                a = tl.trans(a_desc.load([k, m0]))
            else:
                a = a_desc.load([m0, k])
            if B_T:
                b = tl.trans(b_desc.load([n0, k]))
            else:
                b = b_desc.load([k, n0])
            acc = _mma(a, b, acc, IEEE, UPCAST)
        c_desc.store([m0, n0], acc.to(ety))
    else:
        rows = m0 + tl.arange(0, BM)
        cols = n0 + tl.max_contiguous(tl.multiple_of(tl.arange(0, BN), BN), BN)
        ks = tl.arange(0, BK)
        a_rows = a_ptr + rows.to(tl.int64)[:, None] * sam
        b_cols = b_ptr + cols.to(tl.int64)[None, :] * sbn
        for k in range(0, Kg, BK):
            kk = k + ks
            a = tl.load(a_rows + kk.to(tl.int64)[None, :] * sak, mask=(rows < Mg)[:, None] & (kk < Kg)[None, :], other=0.0)
            b = tl.load(b_cols + kk.to(tl.int64)[:, None] * sbk, mask=(kk < Kg)[:, None] & (cols < Np)[None, :], other=0.0)
            acc = _mma(a, b, acc, IEEE, UPCAST)
        c = c_ptr + rows.to(tl.int64)[:, None] * scm + cols[None, :]
        tl.store(c, acc.to(ety), mask=(rows < Mg)[:, None] & (cols < Np)[None, :])


def _launch(a_addrs, b_addrs, c_addrs, Ms, Ks, Np, strides, like: torch.Tensor, use_desc: bool,
            a_t: bool = False, b_t: bool = False) -> None:
    """One grouped launch: group g multiplies [Ms[g], Ks[g]] by [Ks[g], Np] into c_addrs[g].
    a_t / b_t: that operand is the transpose of a row-major matrix (strides say how)."""
    device = like.device
    cfg = gemm_config(device)
    BM = cfg["BM"]
    G = len(Ms)
    table = device_table([[a_addrs[g], b_addrs[g], c_addrs[g], Ms[g], Ks[g]] for g in range(G)], torch.int64, device)
    tiles = [(g, t) for g in range(G) for t in range(cdiv(Ms[g], BM))]
    if not tiles or Np == 0:
        return
    tiles_t = device_table(tiles, torch.int32, device)
    if use_desc:
        ensure_descriptor_allocator()
    sam, sak, sbk, sbn, scm = strides
    n_row_tiles = len(tiles)
    _grouped_gemm_kernel[lambda meta: (n_row_tiles * cdiv(Np, meta["BN"]),)](
        table, tiles_t, like, Np, n_row_tiles, next_pow2(n_row_tiles), next_pow2(max(Ks)), sam, sak, sbk, sbn, scm,
        BM=BM, USE_DESC=use_desc, IEEE=like.dtype == torch.float32,
        UPCAST=like.dtype == torch.bfloat16 and _interpreting(device), A_T=a_t, B_T=b_t, BAND=cfg["BAND"],
    )


def _descriptors_fit(tensors, row_elems: list[int], device: torch.device) -> bool:
    if not _PREFER_DESCRIPTORS:
        return False
    if not _interpreting(device):
        if device.type != "cuda" or capability(device) < (9, 0):
            return False
    e = tensors[0].element_size()
    return all(t.data_ptr() % 16 == 0 for t in tensors) and all((n * e) % 16 == 0 for n in row_elems)


def _group_starts(stacked: torch.Tensor, Ms: list[int]) -> list[int]:
    """The address of each group's first row in `stacked` [sum M_i, width] (groups in order)."""
    row_bytes = stacked.shape[1] * stacked.element_size()
    addrs, row = [], 0
    for m in Ms:
        addrs.append(stacked.data_ptr() + row * row_bytes)
        row += m
    return addrs


def grouped_gemm_forward_triton(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """c stacked [sum M_i, N] (row-major, groups in order). a_i [M_i, K], b_i [K, N] contiguous."""
    K, N = b[0].shape
    Ms = [x.shape[0] for x in a]
    c = new_empty((sum(Ms), N), a[0].dtype, a[0].device)
    use_desc = _descriptors_fit(list(a) + list(b) + [c], [K, N], c.device)
    _launch([x.data_ptr() for x in a], [w.data_ptr() for w in b], _group_starts(c, Ms),
            Ms, [K] * len(a), N, (K, 1, N, 1, N), c, use_desc)
    return c


def grouped_gemm_backward_triton(grad_c: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor],
                                 want_da: bool, want_db: bool):
    """(da stacked [sum M_i, K] or None, db [G, K, N] or None) from grad_c [sum M_i, N] contiguous."""
    K, N = b[0].shape
    Ms = [x.shape[0] for x in a]
    G = len(a)
    dc_addrs = _group_starts(grad_c, Ms)
    da = db = None
    use_desc = _descriptors_fit(list(a) + list(b) + [grad_c], [K, N], grad_c.device)
    if want_da:  # da_i = dc_i @ b_i^T: b_i^T [N, K] is b_i read with strides (1, N)
        da = new_empty((sum(Ms), K), grad_c.dtype, grad_c.device)
        _launch(dc_addrs, [w.data_ptr() for w in b], _group_starts(da, Ms),
                Ms, [N] * G, K, (N, 1, 1, N, K), da, use_desc, b_t=True)
    if want_db:  # db_i = a_i^T @ dc_i: a_i^T [K, M_i] is a_i read with strides (1, K)
        db = new_empty((G, K, N), grad_c.dtype, grad_c.device)
        _launch([x.data_ptr() for x in a], dc_addrs, [db[g].data_ptr() for g in range(G)],
                [K] * G, Ms, N, (1, K, N, 1, N), db, use_desc, a_t=True)
    return da, db
