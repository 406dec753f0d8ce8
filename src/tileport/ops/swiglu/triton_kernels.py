"""SwiGLU (silu-and-mul), Triton backend: one elementwise launch forward, one backward.

    out = x * s * y,  s = sigmoid(x)
    dx  = dout * y * s * (1 + x * (1 - s));  dy = dout * x * s        (fp32 math)

Design: purely elementwise and bandwidth bound (forward moves 3 elements per output, backward
5), so the tensors are walked flat in 1D blocks of BLOCK contiguous elements with 64-bit offsets:
no 2D tile, so no tensor descriptor; BLOCK-aligned offsets (hinted) give 128-bit accesses.
Non-contiguous inputs are copied to contiguous first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileport.shapes import cdiv, next_pow2
from tileport.memory import as_flat, new_empty
from tileport.triton_rows import _interpreting

_GPU_BLOCK = 4096  # elements per program on a GPU (8 warps: 16 per thread)
_GPU_WARPS = 8
_INTERPRETER_BLOCK = 1 << 14  # under TRITON_INTERPRET: few, large programs
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def block_config(n: int, device: torch.device) -> dict:
    if _interpreting(device):
        return dict(BLOCK=max(16, min(_INTERPRETER_BLOCK, next_pow2(n))), num_warps=4)
    return dict(BLOCK=_GPU_BLOCK, num_warps=_GPU_WARPS)


def triton_refusal(dtype) -> str | None:
    if dtype not in _SUPPORTED_DTYPES:
        return f"dtype {dtype} is not one of float32, float16, bfloat16"
    return None


@triton.jit
def _block_offsets(n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
    return offs, offs < n


@triton.jit
def _swiglu_fwd_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs, mask = _block_offsets(n, BLOCK)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = x * tl.sigmoid(x) * y
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(x_ptr, y_ptr, dout_ptr, dx_ptr, dy_ptr, n, BLOCK: tl.constexpr):
    offs, mask = _block_offsets(n, BLOCK)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(x)
    xs = x * s
    dx = g * y * (s + xs * (1.0 - s))
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dy_ptr + offs, (g * xs).to(dy_ptr.dtype.element_ty), mask=mask)



def swiglu_forward_triton(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    out = new_empty(x.shape, x.dtype, x.device)
    cfg = block_config(n, x.device)
    _swiglu_fwd_kernel[(cdiv(n, cfg["BLOCK"]),)](
        as_flat(x), as_flat(y), out, n, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
    return out


def swiglu_backward_triton(grad_out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    dx = new_empty(x.shape, x.dtype, x.device)
    dy = new_empty(y.shape, y.dtype, y.device)
    cfg = block_config(n, x.device)
    _swiglu_bwd_kernel[(cdiv(n, cfg["BLOCK"]),)](
        as_flat(x), as_flat(y), as_flat(grad_out), dx, dy, n, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
    return dx, dy
