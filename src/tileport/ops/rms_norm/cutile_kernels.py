"""RMSNorm, cuTile backend (cuda.tile): the source the Triton kernels are ported from, in
TileGym's direction; the same math as triton_kernels.py:

    rstd = rsqrt(sum(x^2) / D + eps);  y = x * rstd * w
    g = dy * w;  dx = rstd * g - x * (rstd^3 * sum(g * x) / D);  dw = sum_rows dy * x * rstd
    (fp32 inputs: g exact, the sums, rstd, c = rstd^2 sum(g x) / D and g - x c in fp64, dx rounded
    once: `_rms_norm_bwd_kernel`'s FP64_SUMS; why: the docstring of triton_kernels.py's
    `_rms_norm_bwd_kernel`, docs/perf/llm_ops.md's twentieth session)

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
                         WANT_DW: ct.Constant[bool], FP64_SUMS: ct.Constant[bool]):
    """dx [M, D] and, when WANT_DW, partials[p] = sum over this program's rows of dy x rstd;
    grid (P,), program p takes row tiles p, p + P, ... FP64_SUMS (fp32 inputs, launched as
    `_rms_norm_bwd_fp64_kernel`): dx = rstd (g - x c), c = rstd^2 sum(g x) / D, with g = dy w
    exact, x^2 exact and g x rounded once, the sums, rstd, c and the difference in fp64, dx
    rounded once (rstd for dw rounded to fp32); why: triton_kernels.py's `_rms_norm_bwd_kernel`."""
    p = ct.bid(0)
    nprog = ct.num_blocks(0)
    if HAS_WEIGHT:
        wt = ct.load(w, index=(0,), shape=(BD,), padding_mode=ZERO).astype(ct.float32)[None, :]
    dw = ct.zeros((1, BD), dtype=ct.float32)
    for t in range(p, num_tiles, nprog):
        xt = ct.load(x, index=(t, 0), shape=(BM, BD), padding_mode=ZERO).astype(ct.float32)
        dyt = ct.load(dy, index=(t, 0), shape=(BM, BD), padding_mode=ZERO).astype(ct.float32)
        if FP64_SUMS:
            x64 = xt.astype(ct.float64)
            g64 = dyt.astype(ct.float64) * wt.astype(ct.float64) if HAS_WEIGHT else dyt.astype(ct.float64)
            rstd64 = ct.rsqrt(ct.sum(x64 * x64, axis=1, keepdims=True) * (1.0 / D) + eps)
            c = ct.sum(g64 * x64, axis=1, keepdims=True) * (rstd64 * rstd64) * (1.0 / D)
            ct.store(dx, index=(t, 0), tile=((g64 - x64 * c) * rstd64).astype(dx.dtype))
            rstd = rstd64.astype(ct.float32)
        else:
            rstd = ct.rsqrt(ct.sum(xt * xt, axis=1, keepdims=True) * (1.0 / D) + eps)
            g = dyt * wt if HAS_WEIGHT else dyt
            coef = ct.sum(g * xt, axis=1, keepdims=True) * (rstd * rstd * rstd) * (1.0 / D)
            ct.store(dx, index=(t, 0), tile=(g * rstd - xt * coef).astype(dx.dtype))
        if WANT_DW:
            dw = dw + ct.sum(dyt * xt * rstd, axis=0, keepdims=True)
    if WANT_DW:
        ct.store(partials, index=(p, 0), tile=dw)


# The backward of fp32 inputs (FP64_SUMS): the same kernel with 8 worker warps instead of the
# compiler's choice (cuda.tile's hint for normalization kernels with large tiles under register
# pressure). With the default, its fp64 tiles spilled (tileiras 13.4, sm_90 stack frame: 312 B
# at D = 200 with 32-row tiles, 152 at D = 4096, 864 at D = 8192, all with a weight and dw);
# with 8, the compile cases below have none but fp32 D = 8192 with a weight and dw, 8 B (one
# fp64 weight value, converted before the tile loop and reloaded once a tile). A kernel object
# of its own, so that bf16 and fp16 keep the code they had.
_rms_norm_bwd_fp64_kernel = _rms_norm_bwd_kernel.replace_hints(num_worker_warps=8)


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
    fp64_sums = x.dtype == torch.float32
    launch(_rms_norm_bwd_fp64_kernel if fp64_sums else _rms_norm_bwd_kernel, (P,),
           (x2, w, dy2, dx, partials, num_tiles, D, float(eps), BM, BD, weight is not None, want_dw, fp64_sums))
    dw = partials.sum(dim=0).to(weight.dtype) if want_dw else None
    return dx.view(x.shape), dw


def compile_cases() -> list[CutileCompileCase]:
    """Forward and backward at the benchmark's D = 4096 (bf16, weighted) and a ragged D = 200
    (fp32); the fp32 backward (FP64_SUMS, `_rms_norm_bwd_fp64_kernel`, as the host launches it)
    also at D = 4096 (two rows a tile) and 8192 (the widest row, one a tile)."""
    cases = []
    for D, dt in ((4096, "bfloat16"), (200, "float32")):
        BM, BD = row_tiles(8192, D, MAX_D)
        x, w = array_spec(dt, 2), array_spec(dt, 1)
        cases.append(CutileCompileCase(f"rms_norm fwd D={D} {dt}", _rms_norm_fwd_kernel,
                                       [x, w, x, D, 1e-6, BM, BD, True]))
    for D, dt in ((4096, "bfloat16"), (200, "float32"), (4096, "float32"), (8192, "float32")):
        BM, BD = row_tiles(8192, D, MAX_D)
        x, w = array_spec(dt, 2), array_spec(dt, 1)
        fp64_sums = dt == "float32"
        cases.append(CutileCompileCase(f"rms_norm bwd D={D} {dt}",
                                       _rms_norm_bwd_fp64_kernel if fp64_sums else _rms_norm_bwd_kernel,
                                       [x, w, x, x, array_spec("float32", 2), scalar_spec("int32"), D, 1e-6, BM, BD,
                                        True, True, fp64_sums]))
    return cases
