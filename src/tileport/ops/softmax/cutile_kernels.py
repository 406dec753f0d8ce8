"""Softmax over the last dimension, cuTile backend (cuda.tile); the same math and the same row
statistics as triton_kernels.py, whose docstring says why the backward recomputes y from x:

    m = max(x);  r = 1 / sum(exp(x - m));  y = exp(x - m) * r;   stats[row] = (m, r) fp32
    dx = y * (dy - sum(y * dy))          (fp32 inputs: from e = exp(x - m) with fp64 sums,
                                          `_softmax_bwd_kernel`'s FP64_SUMS; why: the docstring
                                          of triton_kernels.py's `_softmax_bwd_kernel`)

A program owns BM rows. Rows up to MAX_TILE_D wide are one [BM, BD] tile (one read of each
input); wider rows (vocabulary-sized) are walked in column chunks of MAX_TILE_D: the forward's
first pass keeps an online max and sum, the second writes y; the backward's first pass forms
sum(y * dy) (fp32 inputs: Z = sum(e) and S = sum(e * dy) in fp64), the second writes dx. x is
loaded with -inf past D, so padded columns add nothing. cuTile chooses the thread layout, TMA or
not, and vector widths.
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from tileport.cutile_support import CutileCompileCase, array_spec, launch, row_tiles, scalar_spec
from tileport.memory import as_rows, new_empty
from tileport.shapes import cdiv

MAX_TILE_D = 16384
NEG_INF = ct.PaddingMode.NEG_INF
ZERO = ct.PaddingMode.ZERO


@ct.kernel
def _softmax_fwd_kernel(x, y, stats, n_chunks: int, BM: ct.Constant[int], BD: ct.Constant[int],
                        ONE_TILE: ct.Constant[bool]):
    """y [M, D] and stats [M, 2] = (max, 1/sum) from x [M, D]; grid (cdiv(M, BM),)."""
    i = ct.bid(0)
    if ONE_TILE:
        xt = ct.load(x, index=(i, 0), shape=(BM, BD), padding_mode=NEG_INF).astype(ct.float32)
        m = ct.max(xt, axis=1, keepdims=True)
        e = ct.exp(xt - m)
        inv = 1.0 / ct.sum(e, axis=1, keepdims=True)
        ct.store(y, index=(i, 0), tile=(e * inv).astype(y.dtype))
    else:
        m = ct.full((BM, 1), float("-inf"), dtype=ct.float32)
        s = ct.zeros((BM, 1), dtype=ct.float32)
        for c in range(n_chunks):
            xt = ct.load(x, index=(i, c), shape=(BM, BD), padding_mode=NEG_INF).astype(ct.float32)
            m_new = ct.maximum(m, ct.max(xt, axis=1, keepdims=True))
            s = s * ct.exp(m - m_new) + ct.sum(ct.exp(xt - m_new), axis=1, keepdims=True)
            m = m_new
        inv = 1.0 / s
        for c in range(n_chunks):
            xt = ct.load(x, index=(i, c), shape=(BM, BD), padding_mode=NEG_INF).astype(ct.float32)
            ct.store(y, index=(i, c), tile=(ct.exp(xt - m) * inv).astype(y.dtype))
    ct.store(stats, index=(i, 0), tile=ct.cat((m, inv), 1))


def _softmax_dx(e, g, delta, z):
    """dx = e (g - delta) / z in fp32 for fp32 tiles e, g and fp64 row sums delta = S / Z, z = Z
    [BM, 1]: Triton's `_softmax_dx` (triton_kernels.py says why): delta split into two fp32 parts,
    hi + lo, so that g - hi is exact where it cancels; the tiles here stay fp32 (fp64 only in the
    row scalars)."""
    hi = delta.astype(ct.float32)
    lo = (delta - hi.astype(ct.float64)).astype(ct.float32)
    return e * ((g - hi) - lo) * (1.0 / z).astype(ct.float32)


@ct.kernel
def _softmax_bwd_kernel(x, stats, dy, dx, n_chunks: int, BM: ct.Constant[int], BD: ct.Constant[int],
                        ONE_TILE: ct.Constant[bool], FP64_SUMS: ct.Constant[bool]):
    """dx [M, D] from x, stats (the forward's) and dy; grid (cdiv(M, BM),). Default: y = e r with e =
    exp(x - m) and the forward's (m, r), fp32 throughout. FP64_SUMS (fp32 inputs): from the same e,
    Z = sum(e) and S = sum(e * dy) summed in fp64, dx = e (dy - S / Z) / Z (`_softmax_dx`; why:
    triton_kernels.py's `_softmax_bwd_kernel`)."""
    i = ct.bid(0)
    st = ct.load(stats, index=(i, 0), shape=(BM, 2), padding_mode=ZERO)
    m = ct.extract(st, index=(0, 0), shape=(BM, 1))
    inv = ct.extract(st, index=(0, 1), shape=(BM, 1))
    # rows past M read x as -inf: e = 0, and with FP64_SUMS Z = 0 and dx NaN there (never stored)
    if ONE_TILE:
        e = ct.exp(ct.load(x, index=(i, 0), shape=(BM, BD), padding_mode=NEG_INF).astype(ct.float32) - m)
        g = ct.load(dy, index=(i, 0), shape=(BM, BD), padding_mode=ZERO).astype(ct.float32)
        if FP64_SUMS:
            e64 = e.astype(ct.float64)
            z = ct.sum(e64, axis=1, keepdims=True)
            dxt = _softmax_dx(e, g, ct.sum(e64 * g.astype(ct.float64), axis=1, keepdims=True) / z, z)
        else:
            yt = e * inv
            dxt = yt * (g - ct.sum(yt * g, axis=1, keepdims=True))
        ct.store(dx, index=(i, 0), tile=dxt.astype(dx.dtype))
    else:
        # first pass: the rows' sum(y * dy), or (FP64_SUMS) their Z and S in fp64
        dot = ct.zeros((BM, 1), dtype=ct.float32)
        z = ct.zeros((BM, 1), dtype=ct.float64)
        s = ct.zeros((BM, 1), dtype=ct.float64)
        for c in range(n_chunks):
            e = ct.exp(ct.load(x, index=(i, c), shape=(BM, BD), padding_mode=NEG_INF).astype(ct.float32) - m)
            g = ct.load(dy, index=(i, c), shape=(BM, BD), padding_mode=ZERO).astype(ct.float32)
            if FP64_SUMS:
                e64 = e.astype(ct.float64)
                z = z + ct.sum(e64, axis=1, keepdims=True)
                s = s + ct.sum(e64 * g.astype(ct.float64), axis=1, keepdims=True)
            else:
                yt = e * inv
                dot = dot + ct.sum(yt * g, axis=1, keepdims=True)
        for c in range(n_chunks):
            e = ct.exp(ct.load(x, index=(i, c), shape=(BM, BD), padding_mode=NEG_INF).astype(ct.float32) - m)
            g = ct.load(dy, index=(i, c), shape=(BM, BD), padding_mode=ZERO).astype(ct.float32)
            if FP64_SUMS:
                dxt = _softmax_dx(e, g, s / z, z)
            else:
                yt = e * inv
                dxt = yt * (g - dot)
            ct.store(dx, index=(i, c), tile=dxt.astype(dx.dtype))


# ----------------------------------------------------------------------------------------
# stages (one launch each)
# ----------------------------------------------------------------------------------------
def _config(M: int, D: int) -> tuple[int, int, int, bool]:
    BM, BD = row_tiles(M, D, MAX_TILE_D)
    return BM, BD, cdiv(D, BD), BD >= D


def softmax_forward_cutile(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y with x's shape and dtype, row statistics (max, 1/sum) [M, 2] fp32 for the backward)."""
    D = x.shape[-1]
    x2 = as_rows(x)
    M = x2.shape[0]
    y = new_empty((M, D), x.dtype, x.device)
    stats = new_empty((M, 2), torch.float32, x.device)
    BM, BD, n_chunks, one_tile = _config(M, D)
    launch(_softmax_fwd_kernel, (cdiv(M, BM),), (x2, y, stats, n_chunks, BM, BD, one_tile))
    return y.view(x.shape), stats


def softmax_backward_cutile(grad_y: torch.Tensor, x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    D = x.shape[-1]
    x2, dy2 = as_rows(x), as_rows(grad_y.to(x.dtype))
    M = x2.shape[0]
    dx = new_empty((M, D), x.dtype, x.device)
    BM, BD, n_chunks, one_tile = _config(M, D)
    launch(_softmax_bwd_kernel, (cdiv(M, BM),), (x2, stats, dy2, dx, n_chunks, BM, BD, one_tile,
                                                 x.dtype == torch.float32))
    return dx.view(x.shape)


def compile_cases() -> list[CutileCompileCase]:
    """One-tile (D = 4096 bf16, D = 200 fp32) and chunked (D = 131072 bf16 and fp32) rows, both
    directions; the fp32 backwards with FP64_SUMS (what the host passes for fp32)."""
    cases = []
    for M, D, dt in ((8192, 4096, "bfloat16"), (130, 200, "float32"), (1024, 131072, "bfloat16"),
                     (1024, 131072, "float32")):
        BM, BD, _n, one = _config(M, D)
        x, st = array_spec(dt, 2), array_spec("float32", 2)
        n = scalar_spec("int32")
        cases.append(CutileCompileCase(f"softmax fwd D={D} {dt}", _softmax_fwd_kernel, [x, x, st, n, BM, BD, one]))
        cases.append(CutileCompileCase(f"softmax bwd D={D} {dt}", _softmax_bwd_kernel,
                                       [x, st, x, x, n, BM, BD, one, dt == "float32"]))
    return cases
