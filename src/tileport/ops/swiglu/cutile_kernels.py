"""SwiGLU, cuTile backend (cuda.tile): out = silu(x) * y elementwise, fp32 math, and its backward

    s = sigmoid(x);  dx = g * y * s * (1 + x (1 - s));  dy = g * x * s

over the flattened tensors as 1D tiles of BLOCK elements (grid: cdiv(n, BLOCK)). cuTile chooses
the vector width and the thread layout; past n the loads pad with 0 and the stores are clipped.
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from tileport.cutile_support import CutileCompileCase, array_spec, launch
from tileport.memory import as_flat, new_empty
from tileport.shapes import cdiv

BLOCK = 4096
ZERO = ct.PaddingMode.ZERO


@ct.kernel
def _swiglu_fwd_kernel(x, y, out, BLOCK: ct.Constant[int]):
    """out[n] = silu(x) * y; grid (cdiv(n, BLOCK),)."""
    i = ct.bid(0)
    xt = ct.load(x, index=(i,), shape=(BLOCK,), padding_mode=ZERO).astype(ct.float32)
    yt = ct.load(y, index=(i,), shape=(BLOCK,), padding_mode=ZERO).astype(ct.float32)
    s = 1.0 / (1.0 + ct.exp(-xt))
    ct.store(out, index=(i,), tile=(xt * s * yt).astype(out.dtype))


@ct.kernel
def _swiglu_bwd_kernel(g, x, y, dx, dy, BLOCK: ct.Constant[int]):
    """dx, dy [n] from the output gradient g; grid (cdiv(n, BLOCK),)."""
    i = ct.bid(0)
    gt = ct.load(g, index=(i,), shape=(BLOCK,), padding_mode=ZERO).astype(ct.float32)
    xt = ct.load(x, index=(i,), shape=(BLOCK,), padding_mode=ZERO).astype(ct.float32)
    yt = ct.load(y, index=(i,), shape=(BLOCK,), padding_mode=ZERO).astype(ct.float32)
    s = 1.0 / (1.0 + ct.exp(-xt))
    ct.store(dx, index=(i,), tile=(gt * yt * s * (1.0 + xt * (1.0 - s))).astype(dx.dtype))
    ct.store(dy, index=(i,), tile=(gt * xt * s).astype(dy.dtype))


def swiglu_forward_cutile(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = new_empty(x.shape, x.dtype, x.device)
    n = x.numel()
    launch(_swiglu_fwd_kernel, (cdiv(n, BLOCK),), (as_flat(x), as_flat(y.to(x.dtype)), out.view(-1), BLOCK))
    return out


def swiglu_backward_cutile(grad_out: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
    dx = new_empty(x.shape, x.dtype, x.device)
    dy = new_empty(y.shape, y.dtype, y.device)
    n = x.numel()
    launch(_swiglu_bwd_kernel, (cdiv(n, BLOCK),),
           (as_flat(grad_out.to(x.dtype)), as_flat(x), as_flat(y), dx.view(-1), dy.view(-1), BLOCK))
    return dx, dy


def compile_cases() -> list[CutileCompileCase]:
    cases = []
    for dt in ("bfloat16", "float32"):
        a = array_spec(dt, 1)
        cases.append(CutileCompileCase(f"swiglu fwd {dt}", _swiglu_fwd_kernel, [a, a, a, BLOCK]))
        cases.append(CutileCompileCase(f"swiglu bwd {dt}", _swiglu_bwd_kernel, [a, a, a, a, a, BLOCK]))
    return cases
