"""Grouped GEMM, Gluon backend for Hopper (sm_90): the forward on a persistent, pipelined TMA +
WGMMA kernel; the backward is Triton's (triton_kernels.py).

c_i = a_i @ b_i for G groups (a_i [M_i, K], b_i [K, N], 16-bit, fp32 accumulation), written into
the stacked c [sum M_i, N]. Why Gluon here (docs/perf/llm_ops.md): Triton's kernel runs at 61% of
the card's matmul rate (1.067 ms at G = 8, M_i = 2048, K = N = 4096 against torch's loop of
matmuls at 0.844); what it leaves to the compiler is the pipeline (how many K steps are in flight
and when a buffer may be refilled) and the grid (one program per output tile). Here one program
per SM walks the output tiles in Triton's banded order, each tile's K steps through a ring of
STAGES (A, B) buffers with one asynchronous WGMMA in flight behind the loads.
"""

from __future__ import annotations

import torch

from tileport.devices import sm_count
from tileport.memory import new_empty
from tileport.ops.grouped_gemm import triton_kernels
from tileport.shapes import cdiv
from tileport.triton_rows import ensure_descriptor_allocator

try:  # the module must import on a CPU machine and without Gluon
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    _GLUON_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the installed triton
    _GLUON_ERROR = f"triton.experimental.gluon is unavailable ({type(exc).__name__}: {exc})"

__all__ = ["gluon_refusal", "grouped_gemm_forward_gluon", "grouped_gemm_backward_gluon", "compile_cases"]

# The tile and the pipeline (read at each launch): BM = 128 rows on two warpgroups, BN = 256
# columns (the widest WGMMA), BK = 64; STAGES (A, B) buffers of 48 KB each; BAND row tiles per
# band (Triton's order: a band's A tiles stay in L2 while its group's B is read once per band).
BM, BN, BK, STAGES, BAND, NUM_WARPS = 128, 256, 64, 4, 8, 8


def gluon_refusal(dtype: torch.dtype, b_dtype: torch.dtype) -> str | None:
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype}: the Gluon grouped GEMM takes bfloat16 and float16 (fp32 inputs multiply in full fp32 on Triton's)"
    if b_dtype != dtype:
        return f"b dtype {b_dtype} differs from a dtype {dtype}"
    return None


if _GLUON_ERROR is None:

    @gluon.jit
    def _issue_k_step(a_desc, b_desc, m0, n0, kk, j, a_s, b_s, bars, pred):
        """TMA K step kk of a tile (A [BM, BK] at (m0, kk BK), B [BK, BN] at (kk BK, n0)) into ring
        slot j % STAGES, on that slot's barrier; nothing when not pred."""
        STAGES: gl.constexpr = a_s.shape[0]
        BK: gl.constexpr = a_s.shape[2]
        slot = j % STAGES
        bar = bars.index(slot)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [m0, kk * BK], bar, a_s.index(slot), pred=pred)
        tma.async_copy_global_to_shared(b_desc, [kk * BK, n0], bar, b_s.index(slot), pred=pred)

    @gluon.jit
    def _grouped_gemm_fwd_kernel(table_ptr, tiles_ptr, c_ptr, N, K, n_row_tiles, n_items,
                                 BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                                 BAND: gl.constexpr):
        """C tiles [BM, BN] of the grouped product, items pid, pid + P, ... (item = a (row tile of
        the tile table, column tile) pair in Triton's banded order; grid (P,), one program per SM,
        2 warpgroups along M). Per item: the group's A [M_g, K] and B [K, N] descriptors are made
        on the device from the group table (a, b addresses, first row in c, M_g), its K steps go
        through a ring of STAGES (A, B) buffers with STAGES - 1 loads ahead and one WGMMA in
        flight, and the fp32 accumulator is stored with a row and column mask (a tile's rows past
        M_g belong to the next group).
        Explicit here (Triton would choose): the persistent grid and the item order, the ring (its
        depth, barriers and phases, counted across items), the refill of a buffer only after both
        warpgroups have retired the product that read it, the accumulator layout."""
        dtype: gl.constexpr = c_ptr.dtype.element_ty
        A_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], dtype)
        B_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BN], dtype)
        ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                        instr_shape=[16, BN, 16])
        a_s = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], A_SL)
        b_s = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], B_SL)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        n_col = gl.cdiv(N, BN)
        nk = gl.cdiv(K, BK)
        per_band = BAND * n_col
        rows = gl.arange(0, BM, layout=gl.SliceLayout(1, ACC_L))
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, ACC_L))
        cnt = 0  # K steps this program has issued before this item: the ring's phases run on across items
        for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
            first = (t // per_band) * BAND
            rows_here = gl.minimum(n_row_tiles - first, BAND)
            r = first + (t % per_band) % rows_here
            n0 = ((t % per_band) // rows_here) * BN
            g = gl.load(tiles_ptr + 2 * r)
            m0 = gl.load(tiles_ptr + 2 * r + 1) * BM
            a_ptr = gl.load(table_ptr + 4 * g).to(gl.pointer_type(dtype))
            b_ptr = gl.load(table_ptr + 4 * g + 1).to(gl.pointer_type(dtype))
            c_row0 = gl.load(table_ptr + 4 * g + 2)
            Mg = gl.load(table_ptr + 4 * g + 3).to(gl.int32)
            a_desc = tma.make_tensor_descriptor(a_ptr, [Mg, K], [K, 1], [BM, BK], A_SL)
            b_desc = tma.make_tensor_descriptor(b_ptr, [K, N], [N, 1], [BK, BN], B_SL)
            for s in gl.static_range(STAGES - 1):
                _issue_k_step(a_desc, b_desc, m0, n0, s, cnt + s, a_s, b_s, bars, s < nk)
            acc = gl.zeros([BM, BN], gl.float32, ACC_L)
            for kk in range(nk):
                j = cnt + kk
                slot = j % STAGES
                mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
                acc = warpgroup_mma(a_s.index(slot), b_s.index(slot), acc, is_async=True)
                acc, _a, _b = warpgroup_mma_wait(1, deps=[acc, a_s.index(slot), b_s.index(slot)])
                gl.thread_barrier()  # both warpgroups have retired step kk - 1's product: its slot may refill
                _issue_k_step(a_desc, b_desc, m0, n0, kk + STAGES - 1, j + STAGES - 1, a_s, b_s, bars,
                              kk + STAGES - 1 < nk)
            acc = warpgroup_mma_wait(0, deps=[acc])  # (one dependency: returned as is, not in a tuple)
            gl.thread_barrier()  # every product of this item retired before the next item's loads
            cnt += nk
            rr = m0 + rows
            cc = n0 + cols
            offs = (c_row0 + rr).to(gl.int64)[:, None] * N + cc[None, :]
            # lint: allow TP001 -- a TMA store (a per-group descriptor clips rows past M_g) needs a 64 KB staging buffer beside the 192 KB ring: the next step (llm_ops.md row 4)
            gl.store(c_ptr + offs, acc.to(dtype), mask=(rr < Mg)[:, None] & (cc < N)[None, :])
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))


def _fits(a: list[torch.Tensor], b: list[torch.Tensor], K: int, N: int) -> bool:
    """Whether TMA can read every a_i and b_i: 16-byte aligned bases and rows, unit last strides."""
    e = b[0].element_size()
    return ((K * e) % 16 == 0 and (N * e) % 16 == 0
            and all(t.data_ptr() % 16 == 0 and t.is_contiguous() for t in list(a) + list(b)))


def grouped_gemm_forward_gluon(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """c stacked [sum M_i, N] (`triton_kernels.grouped_gemm_forward_triton`'s contract); operands
    TMA cannot read (unaligned K or N rows) run Triton's forward."""
    K, N = b[0].shape
    if not _fits(a, b, K, N):
        return triton_kernels.grouped_gemm_forward_triton(a, b)
    Ms = [x.shape[0] for x in a]
    c = new_empty((sum(Ms), N), a[0].dtype, a[0].device)
    tiles = [(g, t) for g in range(len(a)) for t in range(cdiv(Ms[g], BM))]
    if not tiles:  # (K = 0 and N = 0 never reach a backend: the op's entry point answers them)
        return c
    starts = [sum(Ms[:g]) for g in range(len(a))]
    table = torch.tensor([[a[g].data_ptr(), b[g].data_ptr(), starts[g], Ms[g]] for g in range(len(a))],
                         dtype=torch.int64).to(c.device)
    tiles_t = torch.tensor(tiles, dtype=torch.int32).to(c.device)
    n_items = len(tiles) * cdiv(N, BN)
    ensure_descriptor_allocator()  # the device-side descriptors' scratch
    _grouped_gemm_fwd_kernel[(min(n_items, sm_count(c.device)),)](
        table, tiles_t, c, N, K, len(tiles), n_items, BM, BN, BK, STAGES, BAND, num_warps=NUM_WARPS)
    return c


# the backward is Triton's (d a and d b are two more grouped products; the forward is timed first)
grouped_gemm_backward_gluon = triton_kernels.grouped_gemm_backward_triton


# --------------------------------------------------------------------------------------------
# CPU compile checks (tileport.compile_check)
# --------------------------------------------------------------------------------------------
def compile_cases():
    """The forward in bf16 and fp16 at the bench's K = N = 4096."""
    if _GLUON_ERROR is not None:
        return []
    from tileport.compile_check import CompileCase, TensorStandIn

    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        args = dict(table_ptr=TensorStandIn([8, 4], torch.int64), tiles_ptr=TensorStandIn([128, 2], torch.int32),
                    c_ptr=TensorStandIn([16384, 4096], dtype), N=4096, K=4096, n_row_tiles=128, n_items=2048,
                    BM=BM, BN=BN, BK=BK, STAGES=STAGES, BAND=BAND)
        cases.append(CompileCase(name=f"grouped_gemm_fwd_{str(dtype).removeprefix('torch.')}",
                                 kernel=_grouped_gemm_fwd_kernel, args=args, num_warps=NUM_WARPS,
                                 expect_ptx=["wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait",
                                             "tensormap"],
                                 expect_max_spills=0))
    return cases
