"""RoPE (rotate-half form), Triton backend: one launch forward, one backward (the same kernel).

With x = [x1 | x2] (halves of D), cos = [c1 | c2], sin = [s1 | s2] (rows of [T, D]), fp32 math:
    forward   y1 = x1 c1 - x2 s1        y2 = x2 c2 + x1 s2
    backward  dx1 = g1 c1 + g2 s2       dx2 = g2 c2 - g1 s1     (the transpose)
Both are  o1 = a1 c1 - a2 sa,  o2 = a2 c2 + a1 sb  with (sa, sb) = (s1, s2) forward and
(-s2, -s1) backward, so one kernel serves both (BACKWARD constexpr).

Design (bandwidth bound: 2 elements of x per element, cos/sin read once per tile and reused over
the batch-free tile of heads):
- A program owns a [BLOCK_T tokens, BLOCK_H heads, D] box of one batch row; the grid is flat over
  (batch, token tiles, head tiles). cos/sin rows are loaded once per program and broadcast over
  the heads.
- x is read through strides (a q/k slice of a fused qkv projection is not copied); y is
  contiguous [B, T, H, D].
- Tensor descriptors (under the interpreter; on sm_90 only with _DESCRIPTORS_ON_GPU, see there): x and y are viewed as 5D [B, T, H, 2, D/2] so each half is its
  own box ([1, BLOCK_T, BLOCK_H, 1, BLOCK_HALF]); cos and sin as [T, 2, D/2]. Boxes past T, H or
  D/2 are zero-filled on load and clipped on store. They need 16-byte aligned bases and strides
  (D/2 * element size a multiple of 16); otherwise masked raw pointers are used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileport.devices import capability
from tileport.shapes import cdiv, next_pow2
from tileport.memory import new_empty
from tileport.triton_rows import _interpreting, ensure_descriptor_allocator

_GPU_TILE_ELEMS = 4096  # target BLOCK_T * BLOCK_H * BLOCK_HALF (one half) on a GPU
_INTERPRETER_TILE_ELEMS = 1 << 14
_MAX_BOX = 256  # a TMA box dimension is at most 256
MAX_D = 16384
_PREFER_DESCRIPTORS = True
# On the GPU the raw-pointer path is the default: in the sm_90a build (triton 3.6) the descriptor
# path reads its TMA staging buffer with scalar 16-bit shared loads (the 5D box gets a blocked
# layout of one element per thread) and needs 105 registers at H=32, D=128 and 254 at H=40,
# D=64, against 64 with 128-bit global accesses on the pointer path. Flip it to measure.
_DESCRIPTORS_ON_GPU = False
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rope_config(T: int, H: int, D: int, device: torch.device) -> dict:
    half = max(16, next_pow2(D // 2))
    tile = _INTERPRETER_TILE_ELEMS if _interpreting(device) else _GPU_TILE_ELEMS
    block_h = max(1, min(next_pow2(H), tile // half, _MAX_BOX))
    block_t = max(1, min(tile // (block_h * half), next_pow2(T), _MAX_BOX))
    elems = block_t * block_h * half
    num_warps = 4 if elems <= 2048 else (8 if elems <= 8192 else 16)
    return dict(BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=half, num_warps=num_warps)


def triton_refusal(D: int, dtype, cos_dtype) -> str | None:
    if dtype not in _SUPPORTED_DTYPES:
        return f"x dtype {dtype} is not one of float32, float16, bfloat16"
    if cos_dtype not in _SUPPORTED_DTYPES + (torch.float64,):
        return f"cos/sin dtype {cos_dtype} is not a float dtype"
    if D > MAX_D:
        return f"D={D} is over the Triton register cap MAX_D={MAX_D}"
    return None


@triton.jit
def _rope_kernel(
    a_ptr, cos_ptr, sin_ptr, o_ptr, B, T, H, HALF,
    sab, sat, sah, sct, sst, sob, sot, soh,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BACKWARD: tl.constexpr, USE_DESC: tl.constexpr,
):
    pid = tl.program_id(0)
    n_h = tl.cdiv(H, BLOCK_H)
    n_t = tl.cdiv(T, BLOCK_T)
    h0 = (pid % n_h) * BLOCK_H
    t0 = ((pid // n_h) % n_t) * BLOCK_T
    b = pid // (n_h * n_t)
    if USE_DESC:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[B, T, H, 2, HALF], strides=[sab, sat, sah, HALF, 1],
                                           block_shape=[1, BLOCK_T, BLOCK_H, 1, BLOCK_HALF])
        o_desc = tl.make_tensor_descriptor(o_ptr, shape=[B, T, H, 2, HALF], strides=[sob, sot, soh, HALF, 1],
                                           block_shape=[1, BLOCK_T, BLOCK_H, 1, BLOCK_HALF])
        c_desc = tl.make_tensor_descriptor(cos_ptr, shape=[T, 2, HALF], strides=[sct, HALF, 1],
                                           block_shape=[BLOCK_T, 1, BLOCK_HALF])
        s_desc = tl.make_tensor_descriptor(sin_ptr, shape=[T, 2, HALF], strides=[sst, HALF, 1],
                                           block_shape=[BLOCK_T, 1, BLOCK_HALF])
        # the x tiles stay 5D [1, BLOCK_T, BLOCK_H, 1, BLOCK_HALF]; cos/sin are reshaped to
        # [1, BLOCK_T, 1, 1, BLOCK_HALF] and broadcast over the heads.
        a1 = a_desc.load([b, t0, h0, 0, 0]).to(tl.float32)
        a2 = a_desc.load([b, t0, h0, 1, 0]).to(tl.float32)
        c1 = tl.reshape(c_desc.load([t0, 0, 0]), [1, BLOCK_T, 1, 1, BLOCK_HALF]).to(tl.float32)
        c2 = tl.reshape(c_desc.load([t0, 1, 0]), [1, BLOCK_T, 1, 1, BLOCK_HALF]).to(tl.float32)
        s1 = tl.reshape(s_desc.load([t0, 0, 0]), [1, BLOCK_T, 1, 1, BLOCK_HALF]).to(tl.float32)
        s2 = tl.reshape(s_desc.load([t0, 1, 0]), [1, BLOCK_T, 1, 1, BLOCK_HALF]).to(tl.float32)
    else:
        t = t0 + tl.arange(0, BLOCK_T)
        h = h0 + tl.arange(0, BLOCK_H)
        j = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_HALF), BLOCK_HALF), BLOCK_HALF)
        t3 = t.to(tl.int64)[:, None, None]
        j3 = j[None, None, :]
        mask = (t < T)[:, None, None] & (h < H)[None, :, None] & (j < HALF)[None, None, :]
        a_off = b.to(tl.int64) * sab + t3 * sat + h.to(tl.int64)[None, :, None] * sah + j3
        a1 = tl.load(a_ptr + a_off, mask=mask, other=0.0).to(tl.float32)
        a2 = tl.load(a_ptr + a_off + HALF, mask=mask, other=0.0).to(tl.float32)
        cmask = (t < T)[:, None, None] & (j < HALF)[None, None, :]
        c1 = tl.load(cos_ptr + t3 * sct + j3, mask=cmask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t3 * sct + j3 + HALF, mask=cmask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t3 * sst + j3, mask=cmask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + t3 * sst + j3 + HALF, mask=cmask, other=0.0).to(tl.float32)
    if BACKWARD:
        sa = -s2
        sb = -s1
    else:
        sa = s1
        sb = s2
    o1 = a1 * c1 - a2 * sa
    o2 = a2 * c2 + a1 * sb
    if USE_DESC:
        o_desc.store([b, t0, h0, 0, 0], o1.to(o_desc.dtype))
        o_desc.store([b, t0, h0, 1, 0], o2.to(o_desc.dtype))
    else:
        o_off = b.to(tl.int64) * sob + t3 * sot + h.to(tl.int64)[None, :, None] * soh + j3
        tl.store(o_ptr + o_off, o1.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(o_ptr + o_off + HALF, o2.to(o_ptr.dtype.element_ty), mask=mask)


def _desc_strides(t: torch.Tensor, dims: int) -> list[int] | None:
    """Strides of t's leading `dims` dims for a descriptor (a size-1 dim gets the contiguous
    stride it would have), or None when one is not a multiple of 16 bytes."""
    strides = []
    inner = t.shape[-1] * t.stride(-1) if t.dim() > dims else 1
    for i in reversed(range(dims)):
        s = t.stride(i) if t.shape[i] > 1 else inner
        if (s * t.element_size()) % 16:
            return None
        strides.append(s)
        inner = s * t.shape[i]
    return list(reversed(strides))


def _use_descriptors(a, cs, sn, out, device) -> bool:
    if not _PREFER_DESCRIPTORS:
        return False
    if not _interpreting(device):
        if not _DESCRIPTORS_ON_GPU or device.type != "cuda" or capability(device) < (9, 0):
            return False
    half = a.shape[-1] // 2
    for t in (a, cs, sn, out):
        if t.data_ptr() % 16 or (half * t.element_size()) % 16:
            return False
    return all(_desc_strides(t, 3) is not None for t in (a, out)) and all(
        _desc_strides(t, 1) is not None for t in (cs, sn))


def _launch(a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    B, T, H, D = a.shape
    if a.stride(-1) != 1:
        a = a.contiguous()
    cos = cos if cos.dtype != torch.float64 else cos.float()
    sin = sin if sin.dtype != torch.float64 else sin.float()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = new_empty((B, T, H, D), a.dtype, a.device)
    cfg = rope_config(T, H, D, a.device)
    use_desc = _use_descriptors(a, cos, sin, out, a.device)
    if use_desc:
        ensure_descriptor_allocator()
        sa, so = _desc_strides(a, 3), _desc_strides(out, 3)
        sc, ss = _desc_strides(cos, 1)[0], _desc_strides(sin, 1)[0]
    else:
        sa, so = list(a.stride()[:3]), list(out.stride()[:3])
        sc, ss = cos.stride(0), sin.stride(0)
    grid = (B * cdiv(T, cfg["BLOCK_T"]) * cdiv(H, cfg["BLOCK_H"]),)
    _rope_kernel[grid](
        a, cos, sin, out, B, T, H, D // 2, *sa, sc, ss, *so,
        BLOCK_T=cfg["BLOCK_T"], BLOCK_H=cfg["BLOCK_H"], BLOCK_HALF=cfg["BLOCK_HALF"],
        BACKWARD=backward, USE_DESC=use_desc, num_warps=cfg["num_warps"],
    )
    return out


def rope_forward_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _launch(x, cos, sin, backward=False)


def rope_backward_triton(grad_y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _launch(grad_y, cos, sin, backward=True)
