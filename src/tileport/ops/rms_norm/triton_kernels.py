"""RMSNorm, Triton backend: one forward and one backward launch (plus a column sum for d weight).

Per row of x [M, D] (fp32 math, any input dtype):
    rstd = rsqrt(sum(x^2) / D + eps);  y = x * rstd * w
    g = dy * w;  dx = rstd * g - x * (rstd^3 * sum(g * x) / D);  dw = sum_rows dy * x * rstd

Design (bandwidth bound: forward moves 2*M*D elements, backward 3*M*D):
- A program owns BLOCK_M whole rows. When next_pow2(D) <= _MAX_TILE_D the row tile stays in
  registers (ONE_TILE): one read of each input. Wider rows are walked in column chunks of
  BLOCK_D: a first pass forms the row sums, a second re-reads the chunks (hot in L2) and writes.
- 2D tiles move through tensor descriptors (`tl.make_tensor_descriptor`, TMA on Hopper) when the
  base pointers and row strides are 16-byte aligned; otherwise (or before sm_90) through masked
  raw pointers. Out-of-range rows and columns read as 0 either way, which every formula here
  tolerates (a zero row gives rstd = rsqrt(eps), finite, and is never stored).
- Backward programs are persistent: each loops over row tiles and keeps its d weight partial sum
  in registers (ONE_TILE), or read-modify-writes its own fp32 row of `partials` (chunked; a
  barrier per tile orders those accesses inside the CTA). `partials [P, D]` is summed on the host.

The row-tile machinery (descriptor or raw-pointer row tiles, launch configuration, the TMA scratch
allocator) lives in `tileport/triton_rows.py`, shared with softmax, rope and grouped GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileport.shapes import cdiv
from tileport.memory import as_rows, new_empty
from tileport.triton_rows import (  # the row-tile machinery shared by the row-wise ops
    _load_rows,
    _load_vec,
    _make_rows_desc,
    _store_rows,
    descriptors_fit,
    ensure_descriptor_allocator,
    persistent_programs,
    row_config,
)

# Tuning knobs (module constants so that a GPU sweep, or a test, can patch them).
_MAX_TILE_D = 16384  # widest row held in registers whole; wider rows are chunked
_MAX_TILE_D_BWD = 8192  # same for the backward (x, dy, w live together: at D = 16384 fp32 the
#                         sm_90a build of the one-tile backward used 128 registers and spilled)
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

def triton_refusal(D: int, dtype, weight_dtype) -> str | None:
    if dtype not in _SUPPORTED_DTYPES:
        return f"x dtype {dtype} is not one of float32, float16, bfloat16"
    if weight_dtype is not None and weight_dtype not in _SUPPORTED_DTYPES:
        return f"weight dtype {weight_dtype} is not one of float32, float16, bfloat16"
    return None


# ----------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------


# lint: allow-function TP007 -- the alignment hints are in tileport.triton_rows._load_rows/_store_rows (another module: lint does not follow it)
@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, M, D, stride_x, stride_y, eps,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ONE_TILE: tl.constexpr,
    USE_DESC: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):
    row0 = tl.program_id(0) * BLOCK_M
    x_src = _make_rows_desc(x_ptr, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
    y_dst = _make_rows_desc(y_ptr, M, D, stride_y, BLOCK_M, BLOCK_D, USE_DESC)
    if ONE_TILE:
        x = _load_rows(x_src, row0, 0, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        y = x * rstd[:, None]
        if HAS_WEIGHT:
            y = y * _load_vec(w_ptr, 0, D, BLOCK_D)[None, :]
        _store_rows(y_dst, row0, 0, y, M, D, stride_y, BLOCK_M, BLOCK_D, USE_DESC)
    else:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in range(0, D, BLOCK_D):
            x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
            ss += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(ss / D + eps)
        for c in range(0, D, BLOCK_D):
            x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
            y = x * rstd[:, None]
            if HAS_WEIGHT:
                y = y * _load_vec(w_ptr, c, D, BLOCK_D)[None, :]
            _store_rows(y_dst, row0, c, y, M, D, stride_y, BLOCK_M, BLOCK_D, USE_DESC)


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, dw_part_ptr, M, D, stride_x, stride_dy, stride_dx, eps, num_tiles,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ONE_TILE: tl.constexpr,
    USE_DESC: tl.constexpr, HAS_WEIGHT: tl.constexpr, WANT_DW: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    x_src = _make_rows_desc(x_ptr, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
    dy_src = _make_rows_desc(dy_ptr, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
    dx_dst = _make_rows_desc(dx_ptr, M, D, stride_dx, BLOCK_M, BLOCK_D, USE_DESC)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_D), BLOCK_D), BLOCK_D)
    part_row = dw_part_ptr + pid.to(tl.int64) * D
    if ONE_TILE:
        if HAS_WEIGHT:
            w = _load_vec(w_ptr, 0, D, BLOCK_D)
        dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for tile in range(pid, num_tiles, nprog):
            row0 = tile * BLOCK_M
            x = _load_rows(x_src, row0, 0, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
            dy = _load_rows(dy_src, row0, 0, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
            if HAS_WEIGHT:
                g = dy * w[None, :]
            else:
                g = dy
            coef = tl.sum(g * x, axis=1) * (rstd * rstd * rstd) / D
            dx = g * rstd[:, None] - x * coef[:, None]
            _store_rows(dx_dst, row0, 0, dx, M, D, stride_dx, BLOCK_M, BLOCK_D, USE_DESC)
            if WANT_DW:
                dw_acc += tl.sum(dy * x * rstd[:, None], axis=0)
        if WANT_DW:
            tl.store(part_row + cols, dw_acc, mask=cols < D)
    else:
        if WANT_DW:
            for c in range(0, D, BLOCK_D):
                tl.store(part_row + c + cols, tl.zeros([BLOCK_D], dtype=tl.float32), mask=c + cols < D)
            tl.debug_barrier()
        for tile in range(pid, num_tiles, nprog):
            row0 = tile * BLOCK_M
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            gx = tl.zeros([BLOCK_M], dtype=tl.float32)
            for c in range(0, D, BLOCK_D):
                x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
                g = _load_rows(dy_src, row0, c, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
                if HAS_WEIGHT:
                    g = g * _load_vec(w_ptr, c, D, BLOCK_D)[None, :]
                ss += tl.sum(x * x, axis=1)
                gx += tl.sum(g * x, axis=1)
            rstd = tl.rsqrt(ss / D + eps)
            coef = gx * (rstd * rstd * rstd) / D
            for c in range(0, D, BLOCK_D):
                x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
                dy = _load_rows(dy_src, row0, c, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
                if HAS_WEIGHT:
                    g = dy * _load_vec(w_ptr, c, D, BLOCK_D)[None, :]
                else:
                    g = dy
                dx = g * rstd[:, None] - x * coef[:, None]
                _store_rows(dx_dst, row0, c, dx, M, D, stride_dx, BLOCK_M, BLOCK_D, USE_DESC)
                if WANT_DW:
                    pmask = c + cols < D
                    part = tl.load(part_row + c + cols, mask=pmask, other=0.0)
                    tl.store(part_row + c + cols, part + tl.sum(dy * x * rstd[:, None], axis=0), mask=pmask)
            if WANT_DW:
                tl.debug_barrier()  # this tile's partial-row writes before the next tile's reads


# ----------------------------------------------------------------------------------------
# stages (one launch each)
# ----------------------------------------------------------------------------------------



def rms_norm_forward_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y with x's shape and dtype. x [..., D], weight [D] or None."""
    D = x.shape[-1]
    x2 = as_rows(x)
    M = x2.shape[0]
    y = new_empty((M, D), x.dtype, x.device)
    cfg = row_config(M, D, x.device, _MAX_TILE_D)
    use_desc = descriptors_fit([x2, y], x.device)
    if use_desc:
        ensure_descriptor_allocator()
    w = weight.contiguous() if weight is not None else x2
    grid = (cdiv(M, cfg["BLOCK_M"]),)
    _rms_norm_fwd_kernel[grid](
        x2, w, y, M, D, x2.stride(0), y.stride(0), eps,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"], ONE_TILE=cfg["ONE_TILE"],
        USE_DESC=use_desc, HAS_WEIGHT=weight is not None, num_warps=cfg["num_warps"],
    )
    return y.view(x.shape)


def rms_norm_backward_triton(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                             want_dw: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx with x's shape and dtype, d weight in weight's dtype or None)."""
    D = x.shape[-1]
    x2 = as_rows(x)
    dy2 = as_rows(grad_y)
    M = x2.shape[0]
    dx = new_empty((M, D), x.dtype, x.device)
    cfg = row_config(M, D, x.device, min(_MAX_TILE_D, _MAX_TILE_D_BWD))
    num_tiles = cdiv(M, cfg["BLOCK_M"])
    P = persistent_programs(num_tiles, x.device)
    want_dw = want_dw and weight is not None
    partials = new_empty((P, D), torch.float32, x.device) if want_dw else dx
    use_desc = descriptors_fit([x2, dy2, dx], x.device)
    if use_desc:
        ensure_descriptor_allocator()
    w = weight.contiguous() if weight is not None else x2
    _rms_norm_bwd_kernel[(P,)](
        x2, w, dy2, dx, partials, M, D, x2.stride(0), dy2.stride(0), dx.stride(0), eps, num_tiles,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"], ONE_TILE=cfg["ONE_TILE"],
        USE_DESC=use_desc, HAS_WEIGHT=weight is not None, WANT_DW=want_dw, num_warps=cfg["num_warps"],
    )
    dw = partials.sum(dim=0).to(weight.dtype) if want_dw else None
    return dx.view(x.shape), dw
