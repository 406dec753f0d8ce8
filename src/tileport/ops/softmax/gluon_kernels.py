"""Softmax over the last dimension, Gluon backend for Hopper (sm_90): the forward streams row tiles
through a ring of TMA buffers (tileport/gluon_rows.py) in one persistent program per SM; the
backward is Triton's, which recomputes y from x and the forward's row statistics (max, 1/sum)
[M, 2] fp32, written here in Triton's layout.

Per row (fp32 math): m = max(x), r = 1 / sum(exp(x - m)), y = exp(x - m) * r, in x's dtype. Rows
of a power-of-two D from 16 (bf16/fp16) or 8 (fp32) to 8192 elements (`gluon_rows.rows_refusal`:
one TMA box per tile, no padded columns); rows whose base or stride is not 16-byte aligned, which
TMA cannot read, run Triton's forward.
"""

from __future__ import annotations

import torch

from tileport import gluon_rows
from tileport.gluon_rows import _GLUON_ERROR, rows_aligned, rows_refusal, row_stream_plan
from tileport.memory import as_rows, new_empty
from tileport.ops.softmax import triton_kernels

if _GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from tileport.gluon_rows import ring_open, ring_stop, ring_take, row_tile_offsets

__all__ = ["gluon_refusal", "softmax_forward_gluon", "softmax_backward_gluon", "compile_cases"]


def gluon_refusal(D: int, dtype: torch.dtype) -> str | None:
    return rows_refusal(D, dtype)


if _GLUON_ERROR is None:

    @gluon.jit
    def _softmax_fwd_kernel(x_desc, y_ptr, stats_ptr, M, row_stride_y, n_tiles, STAGES: gl.constexpr,
                            L: gl.constexpr):
        """y = exp(x - max) / sum(exp(x - max)) per row, and the row statistics (max, 1/sum), for the
        row tiles pid, pid + P, ... of x (grid (P,), one program per SM): each tile [BM, NCB, CB]
        arrives by TMA into a ring of STAGES shared buffers, is reduced in registers (layout L)
        and stored with a row mask. Explicit here (Triton would choose): as in RMSNorm's
        (`rms_norm.gluon_kernels._rms_norm_fwd_kernel`): the ring, the persistent grid, the host
        descriptor, the tile's register layout."""
        BM: gl.constexpr = x_desc.block_type.shape[0]
        NCB: gl.constexpr = x_desc.block_type.shape[1]
        CB: gl.constexpr = x_desc.block_type.shape[2]
        bufs, bars, pid, P, my_n = ring_open(x_desc, n_tiles, STAGES)
        r = gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        for i in range(my_n):
            x = ring_take(x_desc, bufs, bars, i, pid, P, my_n, L)
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


def softmax_forward_gluon(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y with x's shape and dtype, row statistics [M, 2] fp32): `softmax_forward_triton`'s contract."""
    D = x.shape[-1]
    x2 = as_rows(x)
    if not rows_aligned(x2):
        return triton_kernels.softmax_forward_triton(x)
    M = x2.shape[0]
    y = new_empty((M, D), x.dtype, x.device)
    stats = new_empty((M, 2), torch.float32, x.device)
    plan = row_stream_plan(x2)
    _softmax_fwd_kernel[(plan.programs,)](plan.desc, y, stats, M, y.stride(0), plan.n_tiles, gluon_rows.STAGES,
                                          plan.layout, num_warps=gluon_rows.NUM_WARPS)
    return y.view(x.shape), stats


# the backward is Triton's (it reads the statistics written above)
softmax_backward_gluon = triton_kernels.softmax_backward_triton


# --------------------------------------------------------------------------------------------
# CPU compile checks (tileport.compile_check)
# --------------------------------------------------------------------------------------------
def compile_cases():
    """The forward at D = 4096 and 8192 and 64 (bf16) and 4096 (fp32)."""
    if _GLUON_ERROR is not None:
        return []
    from tileport.compile_check import CompileCase, TensorStandIn
    from tileport.gluon_rows import descriptor_stand_in_for

    cases = []
    M = 8192
    for D, dtype in ((4096, torch.bfloat16), (8192, torch.bfloat16), (64, torch.bfloat16), (4096, torch.float32)):
        desc, layout = descriptor_stand_in_for(M, D, dtype)
        args = dict(x_desc=desc, y_ptr=TensorStandIn([M, D], dtype), stats_ptr=TensorStandIn([M, 2], torch.float32),
                    M=M, row_stride_y=D, n_tiles=M, STAGES=gluon_rows.STAGES, L=layout)
        cases.append(CompileCase(name=f"softmax_fwd_D{D}_{str(dtype).removeprefix('torch.')}",
                                 kernel=_softmax_fwd_kernel, args=args, num_warps=gluon_rows.NUM_WARPS,
                                 expect_ptx=["cp.async.bulk.tensor", "mbarrier.try_wait"], expect_max_spills=0))
    return cases
