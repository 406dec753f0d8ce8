"""RMSNorm, Gluon backend for Hopper (sm_90): the forward streams row tiles through a ring of TMA
buffers (tileport/gluon_rows.py) in one persistent program per SM. The backward (`BACKWARD =
"gluon"`, the default since the H200 gated and timed it: docs/perf/llm_ops.md row 9) streams x and
dy through a paired ring, the weight gradient reduced by a second small kernel;
`BACKWARD = "triton"` runs Triton's backward instead.

Per row (fp32 math, y in x's dtype, as triton_kernels.py): rstd = rsqrt(sum(x^2) / D + eps),
y = x * rstd * w; backward g = dy * w, dx = rstd * g - x * rstd^3 * sum(g * x) / D, and
dw = sum over rows of dy * x * rstd (fp32, then weight's dtype). The backward of fp32 inputs
(FP64_SUMS) forms g = dy * w exactly, both row sums, rstd and dx = rstd * (g - x * c),
c = rstd^2 * sum(g * x) / D, in fp64 and rounds dx once: where g is nearly parallel to x the two
terms cancel, and fp32's roundings came back amplified (triton_kernels' `_rms_norm_bwd_kernel`
says why; docs/perf/llm_ops.md, twentieth session). Rows of a power-of-two D from 16 (bf16/fp16)
or 8 (fp32) to 8192 elements (`gluon_rows.rows_refusal`); rows whose base or stride is not 16-byte
aligned, which TMA cannot read, run Triton's forward (and, with the Gluon backward on, Triton's
backward where x or dy can't be read by TMA).
"""

from __future__ import annotations

import torch

from tileport import gluon_rows
from tileport.gluon_rows import _GLUON_ERROR, backward_pair_plan, rows_aligned, rows_refusal, row_stream_plan, sum_partial_rows
from tileport.memory import as_rows, new_empty
from tileport.ops.rms_norm import triton_kernels

if _GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from tileport.gluon_rows import (pair_ring_open, pair_ring_take, ring_open, ring_stop, ring_take, row_sum_pair,
                                     row_sums, row_tile_offsets, row_vector, row_vector_offsets)

__all__ = ["gluon_refusal", "rms_norm_forward_gluon", "rms_norm_backward_gluon", "compile_cases"]


def gluon_refusal(D: int, dtype: torch.dtype, weight_dtype: torch.dtype | None) -> str | None:
    # the weight is read by plain loads: any of the kernels' dtypes (Triton's refusal checks it)
    return rows_refusal(D, dtype)


if _GLUON_ERROR is None:

    @gluon.jit
    def _rms_norm_fwd_kernel(x_desc, w_ptr, y_ptr, M, row_stride_y, eps, n_tiles, HAS_WEIGHT: gl.constexpr,
                             STAGES: gl.constexpr, L: gl.constexpr):
        """y = x * rsqrt(mean(x^2) + eps) * w for the row tiles pid, pid + P, ... of x (P programs,
        grid (P,), one per SM): each tile [BM, NCB, CB] arrives by TMA into a ring of STAGES shared
        buffers, is reduced and scaled in registers (layout L) and stored with a row mask.
        Explicit here (Triton would choose): the ring (its depth, barriers and phases, the refill
        issued as soon as every warp has read a buffer), the persistent grid, the descriptor built
        on the host, the register layout of the tile (16-byte vectors along the row)."""
        BM: gl.constexpr = x_desc.block_type.shape[0]
        NCB: gl.constexpr = x_desc.block_type.shape[1]
        CB: gl.constexpr = x_desc.block_type.shape[2]
        D: gl.constexpr = NCB * CB
        bufs, bars, pid, P, my_n = ring_open(x_desc, n_tiles, STAGES)
        if HAS_WEIGHT:
            w = row_vector(w_ptr, NCB, CB, L)
        for i in range(my_n):
            x = ring_take(x_desc, bufs, bars, i, pid, P, my_n, L)
            y = x * gl.rsqrt(row_sums(x * x) / D + eps)
            if HAS_WEIGHT:
                y = y * w
            offs, row_ok = row_tile_offsets(pid + i * P, M, row_stride_y, BM, NCB, CB, L)
            # lint: allow TP001 -- rows past M are masked; a TMA store would need a staging buffer per tile for no fewer bytes
            gl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=row_ok)
        ring_stop(bars)


# How many forward programs share an SM, read at each call (a GPU A/B patches it:
# scripts/rows_forward_ab.py). The sm_90a build at 4096 bf16 (8 warps, 115 registers, 0 spills, 4
# slots of 32 KB: one program an SM) has no global load in its tile loop (the weight is loaded
# once before it) and issues its refill ~55% into a step (ptxas sinks the ring's barrier below the
# sum of squares); what nothing on the SM covers is a program's ramp and drain: 2048 tiles over
# 132 programs is ~16 steps of ~2.3 us, the first tile's wait and the last tile's reduction and
# stores (~1.5-3 us of a 37 us kernel) stand alone, as does the late refill's gap.
#   1: one program of NUM_WARPS (8) warps an SM, the plan of `row_stream_plan`.
#   2 (default): two programs an SM (grid 2 x SMs), each of 4 warps, tiles of TILE_BYTES / 2 (2 rows at
#       4096 bf16) in a ring of STAGES (64 KB a program): each program's ramp, drain and late
#       refill are covered by the other's loads.
# Not bitwise: the sum of squares of a row crosses 4 warps instead of 8 (another order), so rstd
# can differ in its last bit; checked against float64 with the parity bound (the A/B prints both).
# 2 since the H200 timed both (scripts/rows_forward_ab.py at e32de5c, graph replays, bf16): 8192 x
# 4096 0.0374 -> 0.0359 ms (85% -> 89% of copy), 4096 x 8192 0.0378 -> 0.0365 (84% -> 87%); the
# rms_norm cases of tests/test_llm_ops_gluon.py but the backward's passed in this form there
# (docs/perf/llm_ops.md row 12).
FORWARD_CTAS_PER_SM = 2
FORWARD_CTAS_PER_SM_FORMS = (1, 2)
_TWO_CTA_WARPS = 4


def _two_cta_plan(x2):
    """The forward's plan for FORWARD_CTAS_PER_SM 2: tiles of TILE_BYTES / 2 (at least one row), a
    ring of STAGES, the default layout over _TWO_CTA_WARPS warps, two programs an SM. x2: [M, D],
    or (M, D, dtype) for compile checks (`gluon_rows.shaped_row_plan`)."""
    from tileport.shapes import next_pow2

    M, D, dtype = x2 if isinstance(x2, tuple) else (*x2.shape, x2.dtype)
    BM = max(1, min(256, gluon_rows.TILE_BYTES // 2 // (D * dtype.itemsize), next_pow2(M)))
    return gluon_rows.shaped_row_plan(x2, BM, gluon_rows.STAGES, _TWO_CTA_WARPS, 2)


def rms_norm_forward_gluon(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y with x's shape and dtype (`triton_kernels.rms_norm_forward_triton`'s contract)."""
    D = x.shape[-1]
    x2 = as_rows(x)
    if not rows_aligned(x2):
        return triton_kernels.rms_norm_forward_triton(x, weight, eps)
    M = x2.shape[0]
    y = new_empty((M, D), x.dtype, x.device)
    if FORWARD_CTAS_PER_SM not in FORWARD_CTAS_PER_SM_FORMS:
        raise ValueError(f"rms_norm gluon FORWARD_CTAS_PER_SM {FORWARD_CTAS_PER_SM!r} is not one of "
                         f"{FORWARD_CTAS_PER_SM_FORMS}")
    if FORWARD_CTAS_PER_SM == 2:
        plan, warps = _two_cta_plan(x2), _TWO_CTA_WARPS
    else:
        plan, warps = row_stream_plan(x2), gluon_rows.NUM_WARPS
    w = weight.contiguous() if weight is not None else x2
    _rms_norm_fwd_kernel[(plan.programs,)](plan.desc, w, y, M, y.stride(0), float(eps), plan.n_tiles,
                                           weight is not None, plan.stages, plan.layout, num_warps=warps)
    return y.view(x.shape)


# Which backward the gluon backend runs, read at each call: "gluon" (the kernels below) or
# "triton" (Triton's kernel). "gluon" since the H200 gated it (tests/test_llm_ops_gluon.py, e5ba5b8)
# and timed it at 8192 x 4096 bf16 as a graph: 0.112 -> 0.057 ms (43% -> 84% of copy), scripts/rows_backward_ab.py,
# docs/perf/llm_ops.md row 9.
BACKWARD = "gluon"
BACKWARDS = ("triton", "gluon")

if _GLUON_ERROR is None:

    @gluon.jit
    def _fresh(t):
        """An fp32 tile through an opaque register copy (an inline `mov`, marked impure so that two
        are never merged nor hoisted out of the tile loop): what is computed from the copy is
        computed again where it is used, not kept from an earlier use. FP64_SUMS forms its fp64
        tiles from fresh copies before the row reduction (the sums) and again after it (dx), so
        only the fp32 tiles live across the reduction: with the fp64 tiles kept (the compiler's
        common subexpressions, the weight's conversion hoisted out of the loop), fp32 D = 8192
        with a weight spilled 328 B at 255 registers."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [t], dtype=gl.float32, is_pure=False, pack=1)

    @gluon.jit
    def _exact_g(dy, w, HAS_WEIGHT: gl.constexpr):
        """g = dy * w in fp64 from fp32 tiles, exact (two 24-bit significands fit in 53 bits), from
        fresh copies (`_fresh`); dy without a weight."""
        if HAS_WEIGHT:
            return _fresh(dy).to(gl.float64) * _fresh(w).to(gl.float64)
        return _fresh(dy).to(gl.float64)

    @gluon.jit
    def _rms_norm_bwd_kernel(x_desc, dy_desc, w_ptr, dx_ptr, part_ptr, M, row_stride_dx, eps, n_tiles,
                             HAS_WEIGHT: gl.constexpr, WANT_DW: gl.constexpr, STAGES: gl.constexpr,
                             L: gl.constexpr, FP64_SUMS: gl.constexpr = False):
        """dx = rstd * g - x * rstd^3 * sum(g * x) / D (g = dy * w, rstd = rsqrt(mean(x^2) + eps)
        recomputed from x) for the row tiles pid, pid + P, ... (grid (P,), one program per SM), and
        with WANT_DW this program's partial weight gradient, sum over its rows of dy * x * rstd,
        as row pid of part [P, D] fp32 (summed by `gluon_rows.sum_partial_rows`). The tiles of x
        and dy arrive together by TMA into a paired ring of STAGES slots (one mbarrier a slot);
        dx is stored from registers with a row mask. Explicit here (Triton would choose): the ring
        and its depth, the persistent grid, the host descriptors, the tile's layout; both row sums
        (x^2 and g * x) in one reduction across warps; the weight gradient accumulated per element
        of the tile, in registers, over all the program's tiles, and reduced over rows once at the
        end (a reduction over rows each tile would cross lanes or warps wherever a warp holds
        several rows).
        FP64_SUMS (fp32 inputs; the host's switch): dx = rstd (g - x c), c = rstd^2 sum(g x) / D,
        with g = dy w exact, x^2 exact and g x rounded once, the sums, rstd, c and the difference in
        fp64, rounded once to fp32 (rstd for dw rounded to fp32). Why: where g is nearly parallel to
        x the two terms cancel to a factor eps / (mean(x^2) + eps) of either, so fp32's roundings of
        g, of the sums and of rstd come back amplified (2.1e-3 against fp32's 1e-5 bound at
        |g| / |dx| ~ 1e4; triton_kernels.py's `_rms_norm_bwd_kernel`, docs/perf/llm_ops.md,
        twentieth session). The fp64 tiles are formed from fresh copies of the fp32 ones twice,
        for the sums and for dx (`_fresh`), so only fp32 tiles live across the reduction (sm_90a:
        0 spills at every fp32 compile case, fp32 D = 8192 with a weight 238 registers; keeping the
        fp64 tiles spilled 328 B there). Not timed on the H200."""
        BM: gl.constexpr = x_desc.block_type.shape[0]
        NCB: gl.constexpr = x_desc.block_type.shape[1]
        CB: gl.constexpr = x_desc.block_type.shape[2]
        D: gl.constexpr = NCB * CB
        INV_D: gl.constexpr = 1.0 / D  # exact (D a power of two)
        xbufs, dybufs, bars, pid, P, my_n = pair_ring_open(x_desc, dy_desc, n_tiles, STAGES)
        if HAS_WEIGHT:
            w = row_vector(w_ptr, NCB, CB, L)
        else:
            w = None
        dw_acc = gl.zeros([BM, NCB, CB], gl.float32, L)
        for i in range(my_n):
            x, dy = pair_ring_take(x_desc, dy_desc, xbufs, dybufs, bars, i, pid, P, my_n, L)
            if FP64_SUMS:
                # fp32 inputs: x^2 exact and g x rounded once in fp64, the sums, rstd, c = rstd^2
                # sum(g x) / D and g - x c in fp64, dx rounded once to fp32 (why: the docstring)
                x64 = _fresh(x).to(gl.float64)
                ss, gx = row_sum_pair(x64 * x64, _exact_g(dy, w, HAS_WEIGHT) * x64)
                rstd64 = gl.rsqrt(ss * INV_D + eps)
                c = gx * rstd64 * rstd64 * INV_D
                dx = (_exact_g(dy, w, HAS_WEIGHT) - _fresh(x).to(gl.float64) * c) * rstd64
                rstd = rstd64.to(gl.float32)
            else:
                if HAS_WEIGHT:
                    g = dy * w
                else:
                    g = dy
                ss, gx = row_sum_pair(x * x, g * x)
                rstd = gl.rsqrt(ss / D + eps)
                dx = g * rstd - x * (gx * (rstd * rstd * rstd) / D)
            offs, row_ok = row_tile_offsets(pid + i * P, M, row_stride_dx, BM, NCB, CB, L)
            # lint: allow TP001 -- rows past M are masked; a TMA store would need a staging buffer per tile for no fewer bytes
            gl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=row_ok)
            if WANT_DW:
                # rows past M came in as zeros (TMA's padding): they add 0
                dw_acc += dy * x * rstd
        ring_stop(bars)
        if WANT_DW:
            gl.store(part_ptr + pid.to(gl.int64) * D + row_vector_offsets(NCB, CB, L), gl.sum(dw_acc, axis=0))


def _rms_norm_backward_ring(grad_y, x, weight, eps, want_dw):
    """The Gluon backward (`triton_kernels.rms_norm_backward_triton`'s contract), or None where TMA
    can't read x or dy (the caller runs Triton's)."""
    setup = backward_pair_plan(x, grad_y)
    if setup is None:
        return None
    plan, x2, dx = setup
    M, D = x2.shape
    want_dw = want_dw and weight is not None
    partials = new_empty((plan.programs, D), torch.float32, x.device) if want_dw else dx
    w = weight.contiguous() if weight is not None else x2
    _rms_norm_bwd_kernel[(plan.programs,)](plan.a_desc, plan.b_desc, w, dx, partials, M, dx.stride(0), float(eps),
                                           plan.n_tiles, weight is not None, want_dw, plan.stages, plan.layout,
                                           FP64_SUMS=x.dtype == torch.float32, num_warps=gluon_rows.NUM_WARPS)
    dw = sum_partial_rows(partials, new_empty((D,), weight.dtype, x.device)) if want_dw else None
    return dx.view(x.shape), dw


def rms_norm_backward_gluon(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                            want_dw: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx with x's shape and dtype, d weight in weight's dtype or None): Triton's backward unless
    BACKWARD is "gluon" (then the Gluon kernels above, and Triton's still for rows TMA can't read).
    grad_y comes in x's dtype (the op's `_backward_impl`)."""
    if BACKWARD not in BACKWARDS:
        raise ValueError(f"rms_norm gluon BACKWARD {BACKWARD!r} is not one of {BACKWARDS}")
    if BACKWARD == "gluon":
        out = _rms_norm_backward_ring(grad_y, x, weight, eps, want_dw)
        if out is not None:
            return out
    return triton_kernels.rms_norm_backward_triton(grad_y, x, weight, eps, want_dw)


# --------------------------------------------------------------------------------------------
# CPU compile checks (tileport.compile_check)
# --------------------------------------------------------------------------------------------
def compile_cases():
    """The forward at D = 4096 and 8192 (bf16, with a weight), 64 (bf16, a tile of many rows) and
    4096 in fp32 without a weight; the backward (`_rms_norm_bwd_kernel`) at D = 4096 bf16 with the
    weight gradient (the standard shape; and in a 6-deep ring of 16 KB tiles, the A/B's other
    ring), 8192 bf16 and fp32 (one row a tile; fp32's ring 3 deep), 64 bf16 (128 rows a tile,
    rows inside warps), 4096 fp16, 4096 fp32 with and without a weight, 64 fp32 (64 rows a tile;
    every fp32 case with FP64_SUMS, as the host launches fp32); and the weight gradient's sum of
    132 partial rows into bf16 and fp32."""
    if _GLUON_ERROR is None:
        from tileport.compile_check import CompileCase, TensorStandIn
        from tileport.gluon_rows import descriptor_stand_in_for, pair_descriptor_stand_in_for, partial_rows_compile_args

        cases = []
        M = 8192
        for D, dtype, weight in ((4096, torch.bfloat16, True), (8192, torch.bfloat16, True), (64, torch.bfloat16, True),
                                 (4096, torch.float32, False)):
            plan = descriptor_stand_in_for(M, D, dtype)
            args = dict(x_desc=plan.desc, w_ptr=TensorStandIn([D], dtype), y_ptr=TensorStandIn([M, D], dtype), M=M,
                        row_stride_y=D, eps=1e-6, n_tiles=M, HAS_WEIGHT=weight, STAGES=gluon_rows.STAGES, L=plan.layout)
            tag = f"D{D}_{str(dtype).removeprefix('torch.')}{'_w' if weight else ''}"
            cases.append(CompileCase(name=f"rms_norm_fwd_{tag}", kernel=_rms_norm_fwd_kernel, args=args,
                                     num_warps=gluon_rows.NUM_WARPS,
                                     expect_ptx=["cp.async.bulk.tensor", "mbarrier.try_wait"], expect_max_spills=0,
                                     # the ring's 3 CTA barriers a tile, and 2 for the sum of squares
                                     # across warps (none at D = 64: a row inside one warp)
                                     expect_loop_barriers=3 if D <= 256 else 5))
        # FORWARD_CTAS_PER_SM 2: 4 warps, 16 KB tiles in a ring of STAGES; two programs must fit
        # an SM's 227 KB of shared memory
        for D, dtype, weight in ((4096, torch.bfloat16, True), (8192, torch.bfloat16, True),
                                 (4096, torch.float32, False)):
            plan = _two_cta_plan((M, D, dtype))
            args = dict(x_desc=plan.desc, w_ptr=TensorStandIn([D], dtype), y_ptr=TensorStandIn([M, D], dtype), M=M,
                        row_stride_y=D, eps=1e-6, n_tiles=plan.n_tiles, HAS_WEIGHT=weight, STAGES=plan.stages,
                        L=plan.layout)
            tag = f"D{D}_{str(dtype).removeprefix('torch.')}{'_w' if weight else ''}_2cta"
            cases.append(CompileCase(name=f"rms_norm_fwd_{tag}", kernel=_rms_norm_fwd_kernel, args=args,
                                     num_warps=_TWO_CTA_WARPS,
                                     expect_ptx=["cp.async.bulk.tensor", "mbarrier.try_wait"], expect_max_spills=0,
                                     expect_max_shared=113 * 1024, expect_loop_barriers=5))
        bf16 = torch.bfloat16
        # weight: True (with its gradient), False (none), "frozen" (a weight, no gradient wanted)
        for D, dtype, weight, ring in ((4096, bf16, True, None), (4096, bf16, True, (16 * 1024, 6)),
                                       (8192, bf16, True, None), (8192, torch.float32, True, None),
                                       (64, bf16, True, None), (4096, torch.float16, True, None),
                                       (4096, torch.float32, False, None), (4096, bf16, "frozen", None),
                                       (4096, torch.float32, True, None), (64, torch.float32, True, None)):
            saved = gluon_rows.PAIR_TILE_BYTES, gluon_rows.PAIR_STAGES
            if ring is not None:
                gluon_rows.PAIR_TILE_BYTES, gluon_rows.PAIR_STAGES = ring
            try:
                plan = pair_descriptor_stand_in_for(M, D, dtype)
            finally:
                gluon_rows.PAIR_TILE_BYTES, gluon_rows.PAIR_STAGES = saved
            args = dict(x_desc=plan.a_desc, dy_desc=plan.b_desc, w_ptr=TensorStandIn([D], dtype),
                        dx_ptr=TensorStandIn([M, D], dtype), part_ptr=TensorStandIn([132, D], torch.float32), M=M,
                        row_stride_dx=D, eps=1e-6, n_tiles=plan.n_tiles, HAS_WEIGHT=bool(weight),
                        WANT_DW=weight is True, STAGES=plan.stages, L=plan.layout, FP64_SUMS=dtype == torch.float32)
            tag = (f"D{D}_{str(dtype).removeprefix('torch.')}{'_w' if weight is True else '_frozen_w' if weight else ''}"
                   f"{f'_{ring[0] // 1024}kx{ring[1]}' if ring else ''}")
            cases.append(CompileCase(name=f"rms_norm_bwd_{tag}", kernel=_rms_norm_bwd_kernel, args=args,
                                     num_warps=gluon_rows.NUM_WARPS,
                                     expect_ptx=["cp.async.bulk.tensor", "mbarrier.try_wait"], expect_max_spills=0,
                                     # the paired ring's 4 CTA barriers a tile (the single ring's 3, and
                                     # one Triton's membar pass puts between the two TMA copies that
                                     # complete on the same mbarrier), and 2 for the two row sums'
                                     # one reduction across warps (none at D = 64)
                                     expect_loop_barriers=4 if D <= 256 else 6))
        for dtype in (bf16, torch.float32):
            cases.append(CompileCase(name=f"rms_norm_dw_sum_D4096_{str(dtype).removeprefix('torch.')}",
                                     kernel=gluon_rows._sum_partial_rows_kernel,
                                     args=partial_rows_compile_args(132, 4096, dtype), num_warps=gluon_rows._PARTIAL_WARPS,
                                     expect_max_spills=0))
        return cases
    return []
