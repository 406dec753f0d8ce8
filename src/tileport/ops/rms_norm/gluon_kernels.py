"""RMSNorm, Gluon backend for Hopper (sm_90): the forward streams row tiles through a ring of TMA
buffers (tileport/gluon_rows.py) in one persistent program per SM; the backward is Triton's.

Per row (fp32 math, y in x's dtype, as triton_kernels.py): rstd = rsqrt(sum(x^2) / D + eps),
y = x * rstd * w. Rows of a power-of-two D from 16 (bf16/fp16) or 8 (fp32) to 8192 elements
(`gluon_rows.rows_refusal`); rows whose base or stride is not 16-byte aligned, which TMA cannot
read, run Triton's forward.
"""

from __future__ import annotations

import torch

from tileport import gluon_rows
from tileport.gluon_rows import _GLUON_ERROR, rows_aligned, rows_refusal, row_stream_plan
from tileport.memory import as_rows, new_empty
from tileport.ops.rms_norm import triton_kernels

if _GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from tileport.gluon_rows import ring_open, ring_stop, ring_take, row_sums, row_tile_offsets, row_vector

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


def rms_norm_forward_gluon(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y with x's shape and dtype (`triton_kernels.rms_norm_forward_triton`'s contract)."""
    D = x.shape[-1]
    x2 = as_rows(x)
    if not rows_aligned(x2):
        return triton_kernels.rms_norm_forward_triton(x, weight, eps)
    M = x2.shape[0]
    y = new_empty((M, D), x.dtype, x.device)
    plan = row_stream_plan(x2)
    w = weight.contiguous() if weight is not None else x2
    _rms_norm_fwd_kernel[(plan.programs,)](plan.desc, w, y, M, y.stride(0), float(eps), plan.n_tiles,
                                           weight is not None, gluon_rows.STAGES, plan.layout,
                                           num_warps=gluon_rows.NUM_WARPS)
    return y.view(x.shape)


# the backward is Triton's (one persistent launch already; the forward is where the ring pays first)
rms_norm_backward_gluon = triton_kernels.rms_norm_backward_triton


# --------------------------------------------------------------------------------------------
# CPU compile checks (tileport.compile_check)
# --------------------------------------------------------------------------------------------
def compile_cases():
    """The forward at D = 4096 and 8192 (bf16, with a weight), 64 (bf16, a tile of many rows) and
    4096 in fp32 without a weight."""
    if _GLUON_ERROR is None:
        from tileport.compile_check import CompileCase, TensorStandIn
        from tileport.gluon_rows import descriptor_stand_in_for

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
        return cases
    return []
