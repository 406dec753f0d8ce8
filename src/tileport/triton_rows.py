"""Row-tile machinery shared by the row-wise Triton ops (rms_norm, softmax, rope, grouped GEMM).

2D row tiles move through tensor descriptors (`tl.make_tensor_descriptor`, TMA on Hopper) when
base pointers and row strides are 16-byte aligned, otherwise through masked raw pointers; either
way out-of-range elements read as 0. Host helpers pick the tile shape and install the scratch
allocator that device-side descriptors need.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileport.devices import capability, sm_count
from tileport.envvars import getenv
from tileport.shapes import next_pow2

# Tuning knobs (module constants so that a GPU sweep, or a test, can patch them).
_CHUNK_D = 4096  # chunk width for wider rows (capped by _MAX_TILE_D)
_GPU_TILE_ELEMS = 4096  # target BLOCK_M * BLOCK_D on a GPU
_INTERPRETER_TILE_ELEMS = 1 << 14  # under TRITON_INTERPRET: few, large programs
_MAX_BLOCK_M = 256  # a TMA box dimension is at most 256
_PREFER_DESCRIPTORS = True  # set False to measure the raw-pointer path on sm_90
_GPU_PROGRAMS_PER_SM = 4  # persistent backward programs per SM
_INTERPRETER_PROGRAMS = 2

# ----------------------------------------------------------------------------------------
# host helpers
# ----------------------------------------------------------------------------------------


def _interpreting(device: torch.device) -> bool:
    return getenv("TRITON_INTERPRET", "0") == "1" or device.type == "cpu"


def _scratch_allocator(size: int, alignment: int, stream):
    # torch's caching allocator returns 512-byte aligned blocks (TMA descriptors need 128).
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_descriptor_allocator() -> None:
    """Install the scratch allocator that `tl.make_tensor_descriptor` needs on the GPU.

    triton keeps the allocator in a ContextVar, so a value set once in the main thread is not
    seen by autograd's per-device backward threads: check (cheaply) before every launch and
    set it where it is missing. A user's own allocator is left in place. The interpreter
    never calls the allocator (checked on triton 3.6.0).
    """
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
    except ImportError:  # a future triton: set it unconditionally
        triton.set_allocator(_scratch_allocator)
        return
    if isinstance(_allocator.get(), NullAllocator):
        triton.set_allocator(_scratch_allocator)


def descriptors_fit(tensors, device: torch.device) -> bool:
    """True when every 2D tensor in `tensors` can back a tensor descriptor: last stride 1, base
    and row stride 16-byte aligned; and the device has TMA (sm_90+) or this is the interpreter."""
    if not _PREFER_DESCRIPTORS:
        return False
    if not _interpreting(device):
        if device.type != "cuda" or capability(device) < (9, 0):
            return False
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if (t.stride(0) * t.element_size()) % 16:  # checked even for one row: it is passed
            return False
    return True


def row_config(M: int, D: int, device: torch.device, max_tile_d: int) -> dict:
    """BLOCK_M, BLOCK_D, ONE_TILE and num_warps for M rows of width D."""
    full = max(16, next_pow2(D))
    if full <= max_tile_d:
        block_d, one_tile = full, True
    else:
        block_d, one_tile = max(16, min(_CHUNK_D, max_tile_d)), False  # max_tile_d: a power of two
    tile = _INTERPRETER_TILE_ELEMS if _interpreting(device) else _GPU_TILE_ELEMS
    block_m = max(1, min(tile // block_d, next_pow2(max(M, 1)), _MAX_BLOCK_M))
    elems = block_m * block_d
    num_warps = 4 if elems <= 2048 else (8 if elems <= 8192 else 16)
    return dict(BLOCK_M=block_m, BLOCK_D=block_d, ONE_TILE=one_tile, num_warps=num_warps)


def persistent_programs(num_tiles: int, device: torch.device) -> int:
    if _interpreting(device):
        cap = _INTERPRETER_PROGRAMS
    else:
        cap = _GPU_PROGRAMS_PER_SM * sm_count(device)
    return max(1, min(num_tiles, cap))


# ----------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------


@triton.jit
def _make_rows_desc(ptr, M, D, stride, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, USE_DESC: tl.constexpr):
    """A [M, D] descriptor with [BLOCK_M, BLOCK_D] blocks, or the raw pointer when not USE_DESC."""
    if USE_DESC:
        src = tl.make_tensor_descriptor(ptr, shape=[M, D], strides=[stride, 1], block_shape=[BLOCK_M, BLOCK_D])
    else:
        src = ptr
    return src


@triton.jit
def _load_rows(src, row0, col0, M, D, stride, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, USE_DESC: tl.constexpr):
    """The [BLOCK_M, BLOCK_D] tile at (row0, col0) in fp32; out-of-range elements read 0."""
    if USE_DESC:
        t = src.load([row0, col0])
    else:
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_D), BLOCK_D), BLOCK_D)
        ptrs = src + rows.to(tl.int64)[:, None] * stride + cols[None, :]
        t = tl.load(ptrs, mask=(rows < M)[:, None] & (cols < D)[None, :], other=0.0)
    return t.to(tl.float32)


@triton.jit
def _store_rows(dst, row0, col0, value, M, D, stride, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, USE_DESC: tl.constexpr):
    """Store the [BLOCK_M, BLOCK_D] tile at (row0, col0); out-of-range elements are dropped."""
    if USE_DESC:
        dst.store([row0, col0], value.to(dst.dtype))
    else:
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_D), BLOCK_D), BLOCK_D)
        ptrs = dst + rows.to(tl.int64)[:, None] * stride + cols[None, :]
        tl.store(ptrs, value.to(dst.dtype.element_ty), mask=(rows < M)[:, None] & (cols < D)[None, :])


@triton.jit
def _load_vec(ptr, col0, D, BLOCK_D: tl.constexpr):
    cols = col0 + tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_D), BLOCK_D), BLOCK_D)
    return tl.load(ptr + cols, mask=cols < D, other=0.0).to(tl.float32)



