"""RMSNorm, cuTile backend (cuda.tile): the source the Triton kernels are ported from, in
TileGym's direction; the same math as triton_kernels.py:

    rstd = rsqrt(sum(x^2) / D + eps);  y = x * rstd * w
    g = dy * w;  dx = rstd * g - x * (rstd^3 * sum(g * x) / D);  dw = sum_rows dy * x * rstd

A program owns BM whole rows as one [BM, BD] tile (BD = next power of two above D), so each input
is read once; rows wider than MAX_D are refused (the Triton backend walks them in chunks). cuTile
chooses what Triton and Gluon make explicit: the threads' layout of the tile, TMA or not for the
loads (the arrays are tiled views with zero padding past D and past M), vector widths.
The backward is persistent: each program strides over the row tiles and keeps its d weight partial
sum as a [1, BD] tile, written to its own row of `partials` ([P, D] fp32, summed on the host).
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from tileport.devices import sm_count
from tileport.cutile_support import CutileCompileCase, array_spec, launch, row_tiles, scalar_spec
from tileport.memory import as_rows, new_empty
from tileport.shapes import cdiv

MAX_D = 8192  # widest row held as one tile (forward and backward)
ZERO = ct.PaddingMode.ZERO


def cutile_refusal(D: int) -> str | None:
    if D > MAX_D:
        return f"D = {D} is wider than {MAX_D}, the widest row the cuTile kernels hold as one tile"
    return None


@ct.kernel
def _rms_norm_fwd_kernel(x, w, y, D: ct.Constant[int], eps: ct.Constant[float], BM: ct.Constant[int],
                         BD: ct.Constant[int], HAS_WEIGHT: ct.Constant[bool]):
    """y [M, D] from x [M, D] and w [D]; grid (cdiv(M, BM),)."""
    i = ct.bid(0)
    xt = ct.load(x, index=(i, 0), shape=(BM, BD), padding_mode=ZERO).astype(ct.float32)
    rstd = ct.rsqrt(ct.sum(xt * xt, axis=1, keepdims=True) * (1.0 / D) + eps)
    yt = xt * rstd
    if HAS_WEIGHT:
        yt = yt * ct.load(w, index=(0,), shape=(BD,), padding_mode=ZERO).astype(ct.float32)[None, :]
    ct.store(y, index=(i, 0), tile=yt.astype(y.dtype))


@ct.kernel
def _rms_norm_bwd_kernel(x, w, dy, dx, partials, num_tiles: int, D: ct.Constant[int], eps: ct.Constant[float],
                         BM: ct.Constant[int], BD: ct.Constant[int], HAS_WEIGHT: ct.Constant[bool],
                         WANT_DW: ct.Constant[bool]):
    """dx [M, D] and, when WANT_DW, partials[p] = sum over this program's rows of dy x rstd;
    grid (P,), program p takes row tiles p, p + P, ..."""
    p = ct.bid(0)
    nprog = ct.num_blocks(0)
    if HAS_WEIGHT:
        wt = ct.load(w, index=(0,), shape=(BD,), padding_mode=ZERO).astype(ct.float32)[None, :]
    dw = ct.zeros((1, BD), dtype=ct.float32)
    for t in range(p, num_tiles, nprog):
        xt = ct.load(x, index=(t, 0), shape=(BM, BD), padding_mode=ZERO).astype(ct.float32)
        dyt = ct.load(dy, index=(t, 0), shape=(BM, BD), padding_mode=ZERO).astype(ct.float32)
        rstd = ct.rsqrt(ct.sum(xt * xt, axis=1, keepdims=True) * (1.0 / D) + eps)
        g = dyt * wt if HAS_WEIGHT else dyt
        coef = ct.sum(g * xt, axis=1, keepdims=True) * (rstd * rstd * rstd) * (1.0 / D)
        ct.store(dx, index=(t, 0), tile=(g * rstd - xt * coef).astype(dx.dtype))
        if WANT_DW:
            dw = dw + ct.sum(dyt * xt * rstd, axis=0, keepdims=True)
    if WANT_DW:
        ct.store(partials, index=(p, 0), tile=dw)


# ----------------------------------------------------------------------------------------
# stages (one launch each)
# ----------------------------------------------------------------------------------------
def rms_norm_forward_cutile(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    D = x.shape[-1]
    x2 = as_rows(x)
    M = x2.shape[0]
    y = new_empty((M, D), x.dtype, x.device)
    BM, BD = row_tiles(M, D, MAX_D)
    w = weight.contiguous() if weight is not None else x2[0]
    launch(_rms_norm_fwd_kernel, (cdiv(M, BM),), (x2, w, y, D, float(eps), BM, BD, weight is not None))
    return y.view(x.shape)


def rms_norm_backward_cutile(grad_y, x, weight, eps: float, want_dw: bool):
    D = x.shape[-1]
    x2, dy2 = as_rows(x), as_rows(grad_y.to(x.dtype))
    M = x2.shape[0]
    dx = new_empty((M, D), x.dtype, x.device)
    BM, BD = row_tiles(M, D, MAX_D)
    num_tiles = cdiv(M, BM)
    P = max(1, min(num_tiles, 2 * sm_count(x.device)))
    want_dw = want_dw and weight is not None
    partials = new_empty((P, D), torch.float32, x.device) if want_dw else dx
    w = weight.contiguous() if weight is not None else x2[0]
    launch(_rms_norm_bwd_kernel, (P,), (x2, w, dy2, dx, partials, num_tiles, D, float(eps), BM, BD,
                                        weight is not None, want_dw))
    dw = partials.sum(dim=0).to(weight.dtype) if want_dw else None
    return dx.view(x.shape), dw


def compile_cases() -> list[CutileCompileCase]:
    """Forward and backward at the benchmark's D = 4096 (bf16, weighted) and a ragged D = 200."""
    cases = []
    for D, dt in ((4096, "bfloat16"), (200, "float32")):
        BM, BD = row_tiles(8192, D, MAX_D)
        x, w = array_spec(dt, 2), array_spec(dt, 1)
        cases.append(CutileCompileCase(f"rms_norm fwd D={D} {dt}", _rms_norm_fwd_kernel,
                                       [x, w, x, D, 1e-6, BM, BD, True]))
        cases.append(CutileCompileCase(f"rms_norm bwd D={D} {dt}", _rms_norm_bwd_kernel,
                                       [x, w, x, x, array_spec("float32", 2), scalar_spec("int32"), D, 1e-6, BM, BD, True, True]))
    return cases
