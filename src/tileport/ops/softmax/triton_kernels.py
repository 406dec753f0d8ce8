"""Softmax over the last dimension, Triton backend: one forward and one backward launch.

Per row of x [M, D] (fp32 math):
    m = max(x);  r = 1 / sum(exp(x - m));  y = exp(x - m) * r
    dx = y * (dy - sum(y * dy))          (fp32 inputs: from e = exp(x - m) with fp64 sums,
                                          `_softmax_bwd_kernel`'s FP64_SUMS)
The forward also writes the row statistics (m, r) [M, 2] (fp32, 8 bytes a row); the backward
recomputes y from x and them, bit for bit the forward's fp32 y, rather than reading the rounded
output: with bf16 outputs, dx from the saved y (what torch does) misses the 1e-2 bound on
peaked rows, where dy - sum(y * dy) cancels. (A single log-sum-exp is not enough in fp32:
x - lse loses |x| * 2^-24 absolutely, 1e-4 relative error in y at logits near 1000.)

Design (bandwidth bound: forward moves 2*M*D elements, backward 3*M*D: x, dy, dx):
- Row tiles, tensor descriptors and the config come from the RMSNorm kernels
  (`tileport.triton_rows`): a program owns BLOCK_M whole rows.
- ONE_TILE (next_pow2(D) <= _MAX_TILE_D): the row tile stays in registers, one read per input.
- Wider rows (vocabulary-sized softmax): the forward makes an online max/sum pass over column
  chunks, then a second pass (re-reading x, hot in L2) writes y; the backward forms
  sum(y * dy) in a first pass and writes dx in a second.
- Columns past D are read as 0 and turned into -inf (forward and backward), so they add nothing
  (a 0 would overflow exp(0 - m) for logits far below 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileport.shapes import cdiv
from tileport.memory import as_rows, new_empty
from tileport.triton_rows import (
    _load_rows,
    _make_rows_desc,
    _store_rows,
    descriptors_fit,
    ensure_descriptor_allocator,
    row_config,
)

_MAX_TILE_D = 16384  # widest row held in registers whole; wider rows are chunked
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_refusal(D: int, dtype) -> str | None:
    if dtype not in _SUPPORTED_DTYPES:
        return f"x dtype {dtype} is not one of float32, float16, bfloat16"
    return None


@triton.jit
def _softmax_fwd_kernel(
    x_ptr, y_ptr, stats_ptr, M, D, stride_x, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ONE_TILE: tl.constexpr, USE_DESC: tl.constexpr,
):
    row0 = tl.program_id(0) * BLOCK_M
    x_src = _make_rows_desc(x_ptr, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
    y_dst = _make_rows_desc(y_ptr, M, D, stride_y, BLOCK_M, BLOCK_D, USE_DESC)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_D), BLOCK_D), BLOCK_D)
    if ONE_TILE:
        x = _load_rows(x_src, row0, 0, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
        x = tl.where((cols < D)[None, :], x, float("-inf"))
        m = tl.max(x, axis=1)
        e = tl.exp(x - m[:, None])
        inv = 1.0 / tl.sum(e, axis=1)
        y = e * inv[:, None]
        _store_rows(y_dst, row0, 0, y, M, D, stride_y, BLOCK_M, BLOCK_D, USE_DESC)
    else:
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        s = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in range(0, D, BLOCK_D):
            x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
            x = tl.where((c + cols < D)[None, :], x, float("-inf"))
            m_new = tl.maximum(m, tl.max(x, axis=1))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
            m = m_new
        inv = 1.0 / s
        for c in range(0, D, BLOCK_D):
            x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
            y = tl.exp(x - m[:, None]) * inv[:, None]
            _store_rows(y_dst, row0, c, y, M, D, stride_y, BLOCK_M, BLOCK_D, USE_DESC)
    rows = row0 + tl.arange(0, BLOCK_M)
    tl.store(stats_ptr + 2 * rows, m, mask=rows < M)
    tl.store(stats_ptr + 2 * rows + 1, inv, mask=rows < M)


@triton.jit
def _softmax_dx(e, dy, delta, z):
    """dx = e (dy - delta) / z in fp32 for fp32 tiles e, dy and fp64 row scalars delta = S / Z, z = Z
    (FP64_SUMS): delta split into two fp32 parts, hi + lo, so that dy - hi is exact where it
    cancels (Sterbenz) and the difference keeps fp32's relative precision; the products and 1 / Z
    add errors relative to dx itself, which cancellation does not amplify. fp64 only in the row
    scalars: fp64 tiles spilled (228-248 B a thread at D = 4096, sm_90a)."""
    hi = delta.to(tl.float32)
    lo = (delta - hi.to(tl.float64)).to(tl.float32)
    return e * ((dy - hi[:, None]) - lo[:, None]) * (1.0 / z).to(tl.float32)[:, None]


@triton.jit
def _softmax_bwd_kernel(
    x_ptr, stats_ptr, dy_ptr, dx_ptr, M, D, stride_x, stride_dy, stride_dx,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ONE_TILE: tl.constexpr, USE_DESC: tl.constexpr,
    FP64_SUMS: tl.constexpr = False,
):
    """dx = y * (dy - sum(y * dy)) for BLOCK_M rows; grid (cdiv(M, BLOCK_M),). Default: y = e r with
    e = exp(x - m) and the forward's (m, r), fp32 throughout. FP64_SUMS (fp32 inputs): the row's
    Z = sum(e) and S = sum(e dy) of the same fp32 e summed in fp64 here, dx = e (dy - S / Z) / Z in
    fp64, rounded once. Why: where dy - sum(y * dy) cancels (a peaked row whose dy agrees with its
    mode), dx is ~100x smaller than y * dy, and the default's errors in y and in the sum (the
    forward's fp32 r, uniform over the row, and an fp32 sum) come back 100x relative: 1.2e-5 against
    fp32's 1e-5 bound on one CI draw (seed 1497261784, (1, 130) chunked). Normalising by the
    backward's own Z of the same e cancels any error common to the row, and the fp64 sums leave
    only each e's own rounding (its effect on S / Z is of dx's size, not of S's)."""
    row0 = tl.program_id(0) * BLOCK_M
    x_src = _make_rows_desc(x_ptr, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
    dy_src = _make_rows_desc(dy_ptr, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
    dx_dst = _make_rows_desc(dx_ptr, M, D, stride_dx, BLOCK_M, BLOCK_D, USE_DESC)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_D), BLOCK_D), BLOCK_D)
    rows = row0 + tl.arange(0, BLOCK_M)
    m = tl.load(stats_ptr + 2 * rows, mask=rows < M, other=0.0)[:, None]
    inv = tl.load(stats_ptr + 2 * rows + 1, mask=rows < M, other=0.0)[:, None]
    if ONE_TILE and FP64_SUMS:
        x = _load_rows(x_src, row0, 0, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
        e = tl.exp(tl.where((cols < D)[None, :], x, float("-inf")) - m)
        dy = _load_rows(dy_src, row0, 0, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
        z = tl.sum(e.to(tl.float64), axis=1)
        delta = tl.sum(e.to(tl.float64) * dy.to(tl.float64), axis=1) / z
        _store_rows(dx_dst, row0, 0, _softmax_dx(e, dy, delta, z), M, D, stride_dx, BLOCK_M, BLOCK_D, USE_DESC)
    elif ONE_TILE:
        x = _load_rows(x_src, row0, 0, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
        y = tl.exp(tl.where((cols < D)[None, :], x, float("-inf")) - m) * inv
        dy = _load_rows(dy_src, row0, 0, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
        delta = tl.sum(y * dy, axis=1)
        _store_rows(dx_dst, row0, 0, y * (dy - delta[:, None]), M, D, stride_dx, BLOCK_M, BLOCK_D, USE_DESC)
    elif FP64_SUMS:
        z = tl.zeros([BLOCK_M], dtype=tl.float64)
        sy = tl.zeros([BLOCK_M], dtype=tl.float64)
        for c in range(0, D, BLOCK_D):
            x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
            e = tl.exp(tl.where((c + cols < D)[None, :], x, float("-inf")) - m)
            dy = _load_rows(dy_src, row0, c, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
            z += tl.sum(e.to(tl.float64), axis=1)
            sy += tl.sum(e.to(tl.float64) * dy.to(tl.float64), axis=1)
        delta = sy / z
        for c in range(0, D, BLOCK_D):
            x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
            e = tl.exp(tl.where((c + cols < D)[None, :], x, float("-inf")) - m)
            dy = _load_rows(dy_src, row0, c, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
            _store_rows(dx_dst, row0, c, _softmax_dx(e, dy, delta, z), M, D, stride_dx, BLOCK_M, BLOCK_D, USE_DESC)
    else:
        delta = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in range(0, D, BLOCK_D):
            x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
            y = tl.exp(tl.where((c + cols < D)[None, :], x, float("-inf")) - m) * inv
            dy = _load_rows(dy_src, row0, c, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
            delta += tl.sum(y * dy, axis=1)
        for c in range(0, D, BLOCK_D):
            x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
            y = tl.exp(tl.where((c + cols < D)[None, :], x, float("-inf")) - m) * inv
            dy = _load_rows(dy_src, row0, c, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
            _store_rows(dx_dst, row0, c, y * (dy - delta[:, None]), M, D, stride_dx, BLOCK_M, BLOCK_D, USE_DESC)


def softmax_forward_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y with x's shape and dtype, row statistics (max, 1/sum) [M, 2] fp32 for the backward)."""
    D = x.shape[-1]
    x2 = as_rows(x)
    M = x2.shape[0]
    y = new_empty((M, D), x.dtype, x.device)
    stats = new_empty((M, 2), torch.float32, x.device)
    cfg = row_config(M, D, x.device, _MAX_TILE_D)
    use_desc = descriptors_fit([x2, y], x.device)
    if use_desc:
        ensure_descriptor_allocator()
    _softmax_fwd_kernel[(cdiv(M, cfg["BLOCK_M"]),)](
        x2, y, stats, M, D, x2.stride(0), y.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"], ONE_TILE=cfg["ONE_TILE"], USE_DESC=use_desc,
        num_warps=cfg["num_warps"],
    )
    return y.view(x.shape), stats


def softmax_backward_triton(grad_y: torch.Tensor, x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """dx with x's shape and dtype, from x and the forward's row statistics."""
    D = x.shape[-1]
    x2 = as_rows(x)
    dy2 = as_rows(grad_y)
    M = x2.shape[0]
    dx = new_empty((M, D), x.dtype, x.device)
    cfg = row_config(M, D, x.device, _MAX_TILE_D)
    use_desc = descriptors_fit([x2, dy2, dx], x.device)
    if use_desc:
        ensure_descriptor_allocator()
    _softmax_bwd_kernel[(cdiv(M, cfg["BLOCK_M"]),)](
        x2, stats, dy2, dx, M, D, x2.stride(0), dy2.stride(0), dx.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"], ONE_TILE=cfg["ONE_TILE"], USE_DESC=use_desc,
        FP64_SUMS=x.dtype == torch.float32, num_warps=cfg["num_warps"],
    )
    return dx.view(x.shape)
