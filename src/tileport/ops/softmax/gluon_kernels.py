"""Softmax over the last dimension, Gluon backend for Hopper (sm_90): the forward streams row tiles
through a ring of TMA buffers (tileport/gluon_rows.py) in one persistent program per SM and writes
the row statistics (max, 1/sum) [M, 2] fp32 in Triton's layout. The backward recomputes y from x
and those statistics, x and dy through a paired ring (`BACKWARD = "gluon"`, the default since
the H200 gated and timed it: docs/perf/llm_ops.md row 9); `BACKWARD = "triton"` runs Triton's
backward instead.

Per row (fp32 math): m = max(x), r = 1 / sum(exp(x - m)), y = exp(x - m) * r, in x's dtype;
backward dx = y * (dy - sum(y * dy)) with y recomputed in fp32; for fp32 inputs from e = exp(x - m)
and its fp64 row sums Z = sum(e), S = sum(e * dy): dx = e (dy - S / Z) / Z (`_softmax_bwd_kernel`'s
FP64_SUMS; why: the docstring of triton_kernels.py's `_softmax_bwd_kernel`). Rows
of a power-of-two D from 16 (bf16/fp16) or 8 (fp32) to 8192 elements (`gluon_rows.rows_refusal`:
one TMA box per tile, no padded columns); rows whose base or stride is not 16-byte aligned, which
TMA cannot read, run Triton's forward (and, with the Gluon backward on, Triton's backward where x
or dy can't be read by TMA).
"""

from __future__ import annotations

import torch

from tileport import gluon_rows
from tileport.gluon_rows import _GLUON_ERROR, backward_pair_plan, rows_aligned, rows_refusal, row_stream_plan
from tileport.memory import as_rows, new_empty
from tileport.ops.softmax import triton_kernels
from tileport.shapes import next_pow2

if _GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from tileport.gluon_rows import (pair_ring_open, pair_ring_take, ring_open, ring_stop, ring_take, row_sum_pair,
                                     row_sums, row_tile_offsets)

__all__ = ["gluon_refusal", "softmax_forward_gluon", "softmax_backward_gluon", "compile_cases"]


def gluon_refusal(D: int, dtype: torch.dtype) -> str | None:
    return rows_refusal(D, dtype)


# The forward's form, read at each launch (a GPU A/B patches it: scripts/softmax_gluon_ab.py;
# docs/perf/llm_ops.md row 7). Row 3's tile at D = 4096 bf16 is 4 rows each spread
# over the 8 warps, and it reduced each row twice across warps (the max, then the sum of exp):
# two rounds through shared memory and CTA barriers per tile, on one program per SM.
#   "warp_rows" (default): where a ring of tiles of at least one row per warp fits (rows up to
#       8 KB: 16-bit D <= 4096, fp32 D <= 2048; at 4096 bf16, 3 buffers of 64 KB of 8 rows), every
#       row lives inside one warp: both reductions are registers and warp shuffles, no exchange
#       and no CTA barrier beyond the ring's. Wider rows run "two_exchanges".
#   "two_exchanges": row 3's kernel as it was.
# Tried and removed (llm_ops.md row 7, H200 A/B at 8dc64de): one exchange across warps of each
# 256-element chunk's (max, sum of exp) pair, slower at both widths timed (8192 x 4096 bf16 0.050 ms
# against two exchanges' 0.047; 8192 x 8192 0.082 against 0.078): its extra exp per chunk and the
# pair combine cost more than the barriers it saved.
FORM = "warp_rows"
FORMS = ("warp_rows", "two_exchanges")

# How many forward programs share an SM, read at each launch (a GPU A/B patches it:
# scripts/rows_forward_ab.py). The sm_90a build of "warp_rows" at 4096 bf16 (8 warps, 243
# registers, 0 spills, 3 slots of 64 KB: one program an SM) shows ptxas sinking the ring's "slot
# read" barrier and its refill below the tile's max, exp and sum: the TMA for step i + 3 is issued
# ~87% into step i's SASS (RMSNorm's forward: ~55%), so for most of a step only 2 tiles are in
# flight, and with 8 rows a tile a program has ~8 steps (1024 tiles over 132), so the first
# tile's wait (64 KB) and the last tile's compute and stores, overlapped by nothing on that SM,
# are a large share of a 38 us kernel.
#   1 (default): one program of NUM_WARPS (8) warps an SM, the plan of `row_stream_plan`.
#   2: two programs an SM (grid 2 x SMs), each of 4 warps, tiles of 4 rows (32 KB at 4096 bf16)
#       in a ring of 3 (96 KB a program): one program's late refill, ramp and drain are covered
#       by the other's loads; half the bytes wait behind the first and the last tile. Only where
#       "warp_rows" applies (FORM "warp_rows" and `_warp_rows_fit`); elsewhere 1.
# Rows stay inside one warp and each lane holds the same elements of a row in either, so every
# row's max and sum are reduced in the same order: y and the statistics bitwise equal (the A/B
# checks it). compile_cases() builds it at 4096 bf16 and fp16 (0 spills; shared memory for two).
# 1 stays: the H200 (scripts/rows_forward_ab.py at e32de5c, graph replays, bf16) timed 2 at 8192 x
# 4096 0.0395 -> 0.0393 ms and 4096 x 8192 0.0428 -> 0.0425 (both ~81% / 75% of copy), bitwise
# equal: within noise, so the uncovered ramp and drain were not what holds it (llm_ops.md row 12).
FORWARD_CTAS_PER_SM = 1
FORWARD_CTAS_PER_SM_FORMS = (1, 2)
_TWO_CTA_WARPS = 4
_TWO_CTA_RING_BYTES = 96 * 1024  # a program's ring; two and their scratch fit in 227 KB

if _GLUON_ERROR is None:

    @gluon.jit
    def _softmax_fwd_kernel(x_desc, y_ptr, stats_ptr, M, row_stride_y, n_tiles, STAGES: gl.constexpr,
                            L: gl.constexpr, ROWS_IN_WARPS: gl.constexpr):
        """y = exp(x - max) / sum(exp(x - max)) per row, and the row statistics (max, 1/sum), for the
        row tiles pid, pid + P, ... of x (grid (P,), one program per SM): each tile [BM, NCB, CB]
        arrives by TMA into a ring of STAGES shared buffers, is reduced in registers (layout L)
        and stored with a row mask. Explicit here (Triton would choose): as in RMSNorm's
        (`rms_norm.gluon_kernels._rms_norm_fwd_kernel`): the ring, the persistent grid, the host
        descriptor, the tile's register layout; and where the reductions cross warps. With
        ROWS_IN_WARPS, L holds every row inside one warp (the host's plan), so both reductions are
        a thread's registers then warp shuffles: no shared memory, no CTA barrier. Otherwise L
        keeps a 256-element chunk (axis 2) inside one warp and spreads a row's chunks (axis 1)
        over the warps (row 3's form): the row max and the row sum each cross warps through shared
        memory and CTA barriers."""
        BM: gl.constexpr = x_desc.block_type.shape[0]
        NCB: gl.constexpr = x_desc.block_type.shape[1]
        CB: gl.constexpr = x_desc.block_type.shape[2]
        bufs, bars, pid, P, my_n = ring_open(x_desc, n_tiles, STAGES)
        # the rows' indices in the layout of the statistics (the reductions' orders below differ)
        if ROWS_IN_WARPS:
            r = gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(1, L)))
        else:
            r = gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        for i in range(my_n):
            x = ring_take(x_desc, bufs, bars, i, pid, P, my_n, L)
            if ROWS_IN_WARPS:
                # axis 1 first: a thread's own chunks in registers, then one value per row shuffled
                # across the lanes (axis 2 first would shuffle every chunk of the row separately)
                m = gl.max(gl.max(x, axis=1), axis=1)
                e = gl.exp(x - gl.expand_dims(gl.expand_dims(m, 1), 1))
                inv = 1.0 / gl.sum(gl.sum(e, axis=1), axis=1)
                y = e * gl.expand_dims(gl.expand_dims(inv, 1), 1)
            else:
                m = gl.max(gl.max(x, axis=2), axis=1)
                e = gl.exp(x - gl.expand_dims(gl.expand_dims(m, 1), 2))
                inv = 1.0 / gl.sum(gl.sum(e, axis=2), axis=1)
                y = e * gl.expand_dims(gl.expand_dims(inv, 1), 2)
            tile = pid + i * P
            offs, row_ok = row_tile_offsets(tile, M, row_stride_y, BM, NCB, CB, L)
            # lint: allow TP001 -- rows past M are masked; a TMA store would need a staging buffer per tile for no fewer bytes
            gl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=row_ok)
            rows = tile * BM + r
            gl.store(stats_ptr + 2 * rows, m, mask=rows < M)
            gl.store(stats_ptr + 2 * rows + 1, inv, mask=rows < M)
        ring_stop(bars)


def _two_cta_shape(M: int, D: int, itemsize: int) -> tuple[int, int, int, int]:
    """(BM, NCB, CB, stages) of FORWARD_CTAS_PER_SM 2: at least one row a warp of _TWO_CTA_WARPS
    (4 rows of up to 8 KB), as many slots (at most 3) as fit _TWO_CTA_RING_BYTES."""
    CB = min(D, 256)
    BM = max(1, min(256, max(gluon_rows.TILE_BYTES // 2 // (D * itemsize), _TWO_CTA_WARPS), next_pow2(M)))
    return BM, D // CB, CB, max(1, min(3, _TWO_CTA_RING_BYTES // (BM * D * itemsize)))


def _two_cta_plan(x2, programs_per_sm: int = 2):
    """The forward's plan with two programs an SM (FORWARD_CTAS_PER_SM 2): rows inside warps of
    _TWO_CTA_WARPS warps (`_two_cta_shape`), grid min(tiles, 2 x SMs). x2: [M, D], or (M, D, dtype)
    for compile checks (`gluon_rows.shaped_row_plan`)."""
    M, D, dtype = x2 if isinstance(x2, tuple) else (*x2.shape, x2.dtype)
    BM, _, _, stages = _two_cta_shape(M, D, dtype.itemsize)
    return gluon_rows.shaped_row_plan(x2, BM, stages, _TWO_CTA_WARPS, programs_per_sm, warps_along_rows=True)


def softmax_forward_gluon(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y with x's shape and dtype, row statistics [M, 2] fp32): `softmax_forward_triton`'s contract."""
    D = x.shape[-1]
    x2 = as_rows(x)
    if not rows_aligned(x2):
        return triton_kernels.softmax_forward_triton(x)
    M = x2.shape[0]
    y = new_empty((M, D), x.dtype, x.device)
    stats = new_empty((M, 2), torch.float32, x.device)
    if FORM not in FORMS:
        raise ValueError(f"softmax gluon FORM {FORM!r} is not one of {FORMS}")
    if FORWARD_CTAS_PER_SM not in FORWARD_CTAS_PER_SM_FORMS:
        raise ValueError(f"softmax gluon FORWARD_CTAS_PER_SM {FORWARD_CTAS_PER_SM!r} is not one of "
                         f"{FORWARD_CTAS_PER_SM_FORMS}")
    if FORWARD_CTAS_PER_SM == 2 and FORM == "warp_rows" and gluon_rows._warp_rows_fit(D, x2.element_size()):
        plan, warps = _two_cta_plan(x2), _TWO_CTA_WARPS
    else:
        plan, warps = row_stream_plan(x2, rows_in_warps=FORM == "warp_rows"), gluon_rows.NUM_WARPS
    _softmax_fwd_kernel[(plan.programs,)](plan.desc, y, stats, M, y.stride(0), plan.n_tiles, plan.stages,
                                          plan.layout, plan.rows_in_warps, num_warps=warps)
    return y.view(x.shape), stats


# Which backward the gluon backend runs, read at each call: "gluon" (the kernels below) or
# "triton" (Triton's kernel). "gluon" since the H200 gated it (tests/test_llm_ops_gluon.py, e5ba5b8)
# and timed it at 8192 x 4096 bf16 as a graph: 0.091 -> 0.063 ms (52% -> 76% of copy), scripts/rows_backward_ab.py,
# docs/perf/llm_ops.md row 9.
BACKWARD = "gluon"
BACKWARDS = ("triton", "gluon")

# Where the backward loads a tile's row statistics (m, r), read at each call (a GPU A/B patches it:
# scripts/rows_backward_ab.py). The sm_90a builds at 4096 bf16 show the softmax and RMSNorm
# backwards' tile loops alike (~590 and ~565 SASS instructions a tile, 6 CTA barriers each, the same
# 128 KB ring, 0 spills) but for one thing: softmax's loop opens with 4 global loads (LDG) of its
# tile's statistics, and its first exp after the ring's wait needs m. The ring hides TMA's latency
# 3 slots ahead; nothing hides these loads, so a load's latency from HBM (the statistics, 64 KB,
# are read once a call while 201 MB streams through L2) is spent on every tile of a program that
# has no other CTA to cover it.
#   "in_loop" (default): each tile's statistics loaded at the top of its own step (row 9's kernel).
#   "ahead": the next tile's statistics loaded at the top of this step and carried in registers
#       (4 a thread at 4096 bf16), so most of a step (~1.5 us at the copy rate) covers their latency:
#       sm_90a waits for them ~80% into the step's code, after its refill is issued, where it moves
#       them into uniform registers. (Two steps ahead was compiled and dropped: the compiler
#       waits for that load at the same point, ~80% into the step that issued it.)
#   "auto" (default): "ahead" where a tile holds more than one row, "in_loop" where it holds one.
# The same values and the same arithmetic in both forms: dx bitwise equal to "in_loop" in every
# dtype (the float instructions of the PTX identical in order; compile_cases() builds both).
# H200, scripts/rows_backward_ab.py at c836839 + this change (graph replays, one process, bf16):
# 8192 x 4096 (2 rows a tile) 0.0622 -> 0.0528 ms (77% -> 91% of copy), 4096 x 8192 (1 row a
# tile) 0.0600 -> 0.0630 (slower; not understood): hence "auto" (docs/perf/llm_ops.md row 11).
BACKWARD_STATS = "auto"
BACKWARD_STATS_FORMS = ("auto", "in_loop", "ahead")

if _GLUON_ERROR is None:

    @gluon.jit
    def _softmax_dx(e, dy, delta, z):
        """dx = e (dy - delta) / z in fp32 for fp32 tiles e, dy and fp64 row sums delta = S / Z, z = Z
        ([BM, 1, 1]): Triton's `_softmax_dx` (triton_kernels.py says why): delta split into two fp32
        parts, hi + lo, so that dy - hi is exact where it cancels; the tiles here stay fp32 (fp64
        only in the row scalars)."""
        hi = delta.to(gl.float32)
        lo = (delta - hi.to(gl.float64)).to(gl.float32)
        return e * ((dy - hi) - lo) * (1.0 / z).to(gl.float32)

    @gluon.jit
    def _tile_stats(stats_ptr, tile, M, r, BM: gl.constexpr):
        """Row tile `tile`'s statistics (m, r) [BM] fp32 from stats [M, 2], in r's layout; 0 for rows
        past M (so a tile past the last one loads nothing)."""
        rows = tile * BM + r
        m = gl.load(stats_ptr + 2 * rows.to(gl.int64), mask=rows < M, other=0.0)
        inv = gl.load(stats_ptr + 2 * rows.to(gl.int64) + 1, mask=rows < M, other=0.0)
        return m, inv

    @gluon.jit
    def _softmax_bwd_kernel(x_desc, dy_desc, stats_ptr, dx_ptr, M, row_stride_dx, n_tiles, STAGES: gl.constexpr,
                            L: gl.constexpr, FP64_SUMS: gl.constexpr = False, STATS_AHEAD: gl.constexpr = False):
        """dx = y * (dy - sum(y * dy)) per row for the row tiles pid, pid + P, ... (grid (P,), one
        program per SM), from x, dy and the forward's statistics (m, r) [M, 2] fp32. Default: y =
        exp(x - m) * r recomputed in fp32, fp32 throughout. FP64_SUMS (fp32 inputs): from the same
        e = exp(x - m), Z = sum(e) and S = sum(e * dy) summed in fp64 and dx = e (dy - S / Z) / Z
        (`_softmax_dx`; why: triton_kernels.py's `_softmax_bwd_kernel`). The tiles of x and dy
        arrive together by TMA into a paired ring of STAGES slots (one mbarrier a slot), the tile's
        statistics per row by plain loads (8 bytes a row, issued before the ring's wait; with
        STATS_AHEAD a step earlier, the next tile's carried in registers: the host's
        BACKWARD_STATS), dx stored from registers with a row mask. Explicit here (Triton would
        choose): the ring and its depth, the persistent grid, the host descriptors, the tile's
        register layout (a row's 256-element chunks over the warps: one reduction across warps a
        tile, for S and Z together with FP64_SUMS); how early the statistics are loaded."""
        BM: gl.constexpr = x_desc.block_type.shape[0]
        NCB: gl.constexpr = x_desc.block_type.shape[1]
        CB: gl.constexpr = x_desc.block_type.shape[2]
        xbufs, dybufs, bars, pid, P, my_n = pair_ring_open(x_desc, dy_desc, n_tiles, STAGES)
        r = gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        if STATS_AHEAD:
            m_next, inv_next = _tile_stats(stats_ptr, pid, M, r, BM)
        for i in range(my_n):
            tile = pid + i * P
            # rows past M: m = r = 0 on their zero padding, so y = 0 (with FP64_SUMS e = 1, Z = D and
            # S = 0, so dx = 0; never stored)
            if STATS_AHEAD:
                # this tile's statistics went out a step ago; the next tile's go out now (past the
                # program's last tile: rows past M, nothing loaded). sm_90a keeps statistics every
                # thread shares in uniform registers and waits for the next tile's load where it
                # moves them there: after this step's refill is issued, ~80% into the step's code
                m, inv = m_next, inv_next
                m_next, inv_next = _tile_stats(stats_ptr, tile + P, M, r, BM)
            else:
                m, inv = _tile_stats(stats_ptr, tile, M, r, BM)
            x, dy = pair_ring_take(x_desc, dy_desc, xbufs, dybufs, bars, i, pid, P, my_n, L)
            e = gl.exp(x - gl.expand_dims(gl.expand_dims(m, 1), 2))
            if FP64_SUMS:
                # fp64 tiles only on their way into the sums (sm_90a: 0 spills at fp32 D = 4096, 8192)
                e64 = e.to(gl.float64)
                z, s = row_sum_pair(e64, e64 * dy.to(gl.float64))
                dx = _softmax_dx(e, dy, s / z, z)
            else:
                y = e * gl.expand_dims(gl.expand_dims(inv, 1), 2)
                dx = y * (dy - row_sums(y * dy))
            offs, row_ok = row_tile_offsets(tile, M, row_stride_dx, BM, NCB, CB, L)
            # lint: allow TP001 -- rows past M are masked; a TMA store would need a staging buffer per tile for no fewer bytes
            gl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=row_ok)
        ring_stop(bars)


def _stats_ahead(plan) -> bool:
    """Whether the backward's launch on `plan` loads its statistics a step ahead (BACKWARD_STATS)."""
    if BACKWARD_STATS == "auto":
        return plan.a_desc.block_shape[0] > 1  # rows a tile
    return BACKWARD_STATS == "ahead"


def _softmax_backward_ring(grad_y, x, stats):
    """The Gluon backward (`triton_kernels.softmax_backward_triton`'s contract), or None where TMA
    can't read x or dy (the caller runs Triton's)."""
    setup = backward_pair_plan(x, grad_y)
    if setup is None:
        return None
    plan, x2, dx = setup
    M = x2.shape[0]
    _softmax_bwd_kernel[(plan.programs,)](plan.a_desc, plan.b_desc, stats, dx, M, dx.stride(0), plan.n_tiles,
                                          plan.stages, plan.layout, FP64_SUMS=x.dtype == torch.float32,
                                          STATS_AHEAD=_stats_ahead(plan), num_warps=gluon_rows.NUM_WARPS)
    return dx.view(x.shape)


def softmax_backward_gluon(grad_y: torch.Tensor, x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """dx with x's shape and dtype from x and the forward's statistics [M, 2] fp32 (contiguous, as
    both forwards write them): Triton's backward unless BACKWARD is "gluon" (then the Gluon kernel
    above, and Triton's still for rows TMA can't read). grad_y comes in x's dtype."""
    if BACKWARD not in BACKWARDS:
        raise ValueError(f"softmax gluon BACKWARD {BACKWARD!r} is not one of {BACKWARDS}")
    if BACKWARD_STATS not in BACKWARD_STATS_FORMS:
        raise ValueError(f"softmax gluon BACKWARD_STATS {BACKWARD_STATS!r} is not one of {BACKWARD_STATS_FORMS}")
    if BACKWARD == "gluon":
        dx = _softmax_backward_ring(grad_y, x, stats)
        if dx is not None:
            return dx
    return triton_kernels.softmax_backward_triton(grad_y, x, stats)


# --------------------------------------------------------------------------------------------
# CPU compile checks (tileport.compile_check)
# --------------------------------------------------------------------------------------------
def compile_cases():
    """The forward in each form at D = 4096 (bf16: the standard shape; fp16: the most registers, 254
    of 255 with 128 fp32 values a thread), 8192 and 64 (bf16), 2048 and 4096 (fp32), with the CTA
    barriers each tile costs: the ring's 3 (`ring_take`: one before the refill, one around the TMA
    issue, one at the loop's head), 2 per reduction across warps; the backward at D = 4096 (bf16,
    fp16, fp32 with FP64_SUMS), 8192 (bf16, fp32 with FP64_SUMS) and 64 (bf16), and with its
    statistics a step ahead (BACKWARD_STATS "ahead") at 4096 bf16 and fp16, 8192 fp32 and 64 bf16."""
    if _GLUON_ERROR is not None:
        return []
    from tileport.compile_check import CompileCase, TensorStandIn
    from tileport.gluon_rows import descriptor_stand_in_for

    bf16, fp32 = torch.bfloat16, torch.float32
    cases = []
    M = 8192
    # (D, dtype, form, barriers per tile): rows inside warps 3, row 3's two exchanges 8;
    # D = 64 keeps a row inside one warp in every form
    for D, dtype, form, barriers in ((4096, bf16, "warp_rows", 3), (4096, torch.float16, "warp_rows", 3),
                                     (8192, bf16, "warp_rows", 8),
                                     (64, bf16, "warp_rows", 3), (2048, fp32, "warp_rows", 3),
                                     (4096, fp32, "warp_rows", 8),
                                     (4096, bf16, "two_exchanges", 8), (64, bf16, "two_exchanges", 3)):
        plan = descriptor_stand_in_for(M, D, dtype, rows_in_warps=form == "warp_rows")
        args = dict(x_desc=plan.desc, y_ptr=TensorStandIn([M, D], dtype),
                    stats_ptr=TensorStandIn([M, 2], torch.float32), M=M, row_stride_y=D, n_tiles=M,
                    STAGES=plan.stages, L=plan.layout, ROWS_IN_WARPS=plan.rows_in_warps)
        tag = f"D{D}_{str(dtype).removeprefix('torch.')}_{form}"
        cases.append(CompileCase(name=f"softmax_fwd_{tag}", kernel=_softmax_fwd_kernel, args=args,
                                 num_warps=gluon_rows.NUM_WARPS, expect_ptx=["cp.async.bulk.tensor", "mbarrier.try_wait"],
                                 expect_max_spills=0, expect_loop_barriers=barriers))
    # FORWARD_CTAS_PER_SM 2: 4 warps, 4-row tiles in a ring of 3; two programs must fit an SM's
    # 227 KB of shared memory (and 2 x 128 threads x <= 255 registers fit its 64 K)
    for D, dtype in ((4096, bf16), (4096, torch.float16), (2048, fp32), (64, bf16)):
        plan = _two_cta_plan((M, D, dtype))
        args = dict(x_desc=plan.desc, y_ptr=TensorStandIn([M, D], dtype),
                    stats_ptr=TensorStandIn([M, 2], torch.float32), M=M, row_stride_y=D, n_tiles=plan.n_tiles,
                    STAGES=plan.stages, L=plan.layout, ROWS_IN_WARPS=True)
        cases.append(CompileCase(name=f"softmax_fwd_D{D}_{str(dtype).removeprefix('torch.')}_warp_rows_2cta",
                                 kernel=_softmax_fwd_kernel, args=args, num_warps=_TWO_CTA_WARPS,
                                 expect_ptx=["cp.async.bulk.tensor", "mbarrier.try_wait"], expect_max_spills=0,
                                 expect_max_shared=113 * 1024, expect_loop_barriers=3))
    # the backward (`_softmax_bwd_kernel`): the paired ring's 4 CTA barriers a tile (the single
    # ring's 3, and one Triton's membar pass puts between the two TMA copies that complete on one
    # mbarrier), 2 for the sum of y * dy across warps (none at D = 64; fp32, FP64_SUMS: Z and S in
    # one reduction, so 2 as well); 8192 fp32's ring is 3 deep
    from tileport.gluon_rows import pair_descriptor_stand_in_for

    # (D, dtype, BACKWARD_STATS): every class in the default form; "ahead" (the statistics a step
    # early) at the standard shape, the most registers (fp16), the widest fp32 rows and a small D
    # (64 rows a tile)
    for D, dtype, stats in ((4096, bf16, "in_loop"), (4096, torch.float16, "in_loop"), (8192, bf16, "in_loop"),
                            (64, bf16, "in_loop"), (4096, fp32, "in_loop"), (8192, fp32, "in_loop"),
                            (4096, bf16, "ahead"), (4096, torch.float16, "ahead"), (8192, fp32, "ahead"),
                            (64, bf16, "ahead")):
        plan = pair_descriptor_stand_in_for(M, D, dtype)
        args = dict(x_desc=plan.a_desc, dy_desc=plan.b_desc, stats_ptr=TensorStandIn([M, 2], torch.float32),
                    dx_ptr=TensorStandIn([M, D], dtype), M=M, row_stride_dx=D, n_tiles=plan.n_tiles,
                    STAGES=plan.stages, L=plan.layout, FP64_SUMS=dtype == fp32, STATS_AHEAD=stats == "ahead")
        tag = f"D{D}_{str(dtype).removeprefix('torch.')}{'_stats_ahead' if stats == 'ahead' else ''}"
        cases.append(CompileCase(name=f"softmax_bwd_{tag}", kernel=_softmax_bwd_kernel,
                                 args=args, num_warps=gluon_rows.NUM_WARPS,
                                 expect_ptx=["cp.async.bulk.tensor", "mbarrier.try_wait"], expect_max_spills=0,
                                 expect_loop_barriers=4 if D <= 256 else 6))
    return cases
