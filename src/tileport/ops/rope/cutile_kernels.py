"""RoPE (rotate-half form), cuTile backend (cuda.tile); the same math as triton_kernels.py:

    o1 = a1 c1 - a2 sa,   o2 = a2 c2 + a1 sb
    forward (a = x): (sa, sb) = (s1, s2);   backward (a = dy): (sa, sb) = (-s2, -s1)

with [x1 | x2], [c1 | c2], [s1 | s2] the halves of D. x and y are viewed as 5D [B, T, H, 2, D/2]
and cos, sin as [T, 2, D/2], so each half is its own tile (D/2 need not be a power of two: tiles
are padded to BHALF and clipped on store). A program owns a [1, BT, BH, 1, BHALF] box of one batch
row and loads the cos/sin rows of its BT tokens once for its BH heads; grid (B * cdiv(T, BT),
cdiv(H, BH)). cuTile chooses the thread layout, TMA or not, and vector widths.
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from tileport.shapes import cdiv, next_pow2
from tileport.cutile_support import CutileCompileCase, array_spec, launch, scalar_spec
from tileport.memory import new_empty

TILE_ELEMS = 4096  # BT * BH * BHALF for one half
ZERO = ct.PaddingMode.ZERO


@ct.kernel
def _rope_kernel(a, cos, sin, o, n_t_tiles: int, BT: ct.Constant[int], BH: ct.Constant[int],
                 BHALF: ct.Constant[int], BACKWARD: ct.Constant[bool]):
    """o [B, T, H, 2, D/2] from a (x forward, dy backward) and cos, sin [T, 2, D/2]."""
    b = ct.bid(0) // n_t_tiles
    t = ct.bid(0) % n_t_tiles
    h = ct.bid(1)
    box = (1, BT, BH, 1, BHALF)
    a1 = ct.load(a, index=(b, t, h, 0, 0), shape=box, padding_mode=ZERO).astype(ct.float32)
    a2 = ct.load(a, index=(b, t, h, 1, 0), shape=box, padding_mode=ZERO).astype(ct.float32)
    row = (BT, 1, BHALF)
    c1 = ct.reshape(ct.load(cos, index=(t, 0, 0), shape=row, padding_mode=ZERO).astype(ct.float32), (1, BT, 1, 1, BHALF))
    c2 = ct.reshape(ct.load(cos, index=(t, 1, 0), shape=row, padding_mode=ZERO).astype(ct.float32), (1, BT, 1, 1, BHALF))
    s1 = ct.reshape(ct.load(sin, index=(t, 0, 0), shape=row, padding_mode=ZERO).astype(ct.float32), (1, BT, 1, 1, BHALF))
    s2 = ct.reshape(ct.load(sin, index=(t, 1, 0), shape=row, padding_mode=ZERO).astype(ct.float32), (1, BT, 1, 1, BHALF))
    if BACKWARD:
        o1 = a1 * c1 + a2 * s2
        o2 = a2 * c2 - a1 * s1
    else:
        o1 = a1 * c1 - a2 * s1
        o2 = a2 * c2 + a1 * s2
    ct.store(o, index=(b, t, h, 0, 0), tile=o1.astype(o.dtype))
    ct.store(o, index=(b, t, h, 1, 0), tile=o2.astype(o.dtype))


def rope_tiles(T: int, H: int, D: int) -> tuple[int, int, int]:
    bhalf = max(16, next_pow2(D // 2))
    bh = max(1, min(next_pow2(H), TILE_ELEMS // bhalf))
    bt = max(1, min(TILE_ELEMS // (bh * bhalf), next_pow2(T)))
    return bt, bh, bhalf


def _launch(a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    B, T, H, D = a.shape
    half = D // 2
    a5 = a.contiguous().view(B, T, H, 2, half)
    cs = cos.to(torch.float32) if cos.dtype == torch.float64 else cos
    sn = sin.to(torch.float32) if sin.dtype == torch.float64 else sin
    cs, sn = cs.contiguous().view(T, 2, half), sn.contiguous().view(T, 2, half)
    out = new_empty((B, T, H, D), a.dtype, a.device)
    BT, BH, BHALF = rope_tiles(T, H, D)
    nt = cdiv(T, BT)
    launch(_rope_kernel, (B * nt, cdiv(H, BH)), (a5, cs, sn, out.view(B, T, H, 2, half), nt, BT, BH, BHALF, backward))
    return out


def rope_forward_cutile(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _launch(x, cos, sin, backward=False)


def rope_backward_cutile(grad_y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _launch(grad_y, cos, sin, backward=True)


def compile_cases() -> list[CutileCompileCase]:
    """The benchmark's (T=4096, H=32, D=128) bf16 and a ragged fp32 case (H=5, D=96: halves of 48)."""
    cases = []
    for T, H, D, dt in ((4096, 32, 128, "bfloat16"), (7, 5, 96, "float32")):
        BT, BH, BHALF = rope_tiles(T, H, D)
        x, cs = array_spec(dt, 5), array_spec("float32", 3)
        for bwd in (False, True):
            cases.append(CutileCompileCase(f"rope {'bwd' if bwd else 'fwd'} H={H} D={D} {dt}", _rope_kernel,
                                           [x, cs, cs, x, scalar_spec("int32"), BT, BH, BHALF, bwd]))
    return cases
