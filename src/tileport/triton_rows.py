"""Row-tile machinery shared by the row-wise Triton ops (rms_norm, softmax, rope, grouped GEMM).

2D row tiles move through tensor descriptors (`tl.make_tensor_descriptor`, TMA on Hopper) when
base pointers and row strides are 16-byte aligned, otherwise through masked raw pointers; either
way out-of-range elements read as 0. Host helpers pick the tile shape and install the scratch
allocator that device-side descriptors need. `sum_partial_rows` sums a [P, D] fp32 buffer of
per-program partial rows (a weight gradient's) into one row, in a fixed order, in one launch.
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
_GPU_PROGRAMS_PER_SM = 4  # persistent programs per SM where the caller names no count
_INTERPRETER_PROGRAMS = 2
_PARTIAL_COLS = 32  # columns per program of `sum_partial_rows` (128 programs at D = 4096)
_PARTIAL_ROWS = 256  # partial rows per load there: all of them in one load when P <= 256

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


def row_width(D: int, max_tile_d: int) -> tuple[int, bool]:
    """(BLOCK_D, ONE_TILE) for rows of width D: the whole row in one tile when its power of two is
    at most max_tile_d (a power of two), else column chunks of BLOCK_D."""
    full = max(16, next_pow2(D))
    if full <= max_tile_d:
        return full, True
    return max(16, min(_CHUNK_D, max_tile_d)), False


@triton.constexpr_function
def tile_rows(tile_elems: int, block_d: int) -> int:
    """Rows of a row tile of about tile_elems elements whose columns are block_d wide (at least 1,
    at most a TMA box's 256). A constexpr function: kernels and the host compute it alike."""
    return max(1, min(tile_elems // block_d, _MAX_BLOCK_M))


def row_config(M: int, D: int, device: torch.device, max_tile_d: int) -> dict:
    """BLOCK_M, BLOCK_D, ONE_TILE and num_warps for M rows of width D."""
    block_d, one_tile = row_width(D, max_tile_d)
    tile = _INTERPRETER_TILE_ELEMS if _interpreting(device) else _GPU_TILE_ELEMS
    block_m = max(1, min(tile // block_d, next_pow2(max(M, 1)), _MAX_BLOCK_M))
    elems = block_m * block_d
    num_warps = 4 if elems <= 2048 else (8 if elems <= 8192 else 16)
    return dict(BLOCK_M=block_m, BLOCK_D=block_d, ONE_TILE=one_tile, num_warps=num_warps)


def persistent_programs(num_tiles: int, device: torch.device, per_sm: int | None = None) -> int:
    """Programs of a persistent grid over num_tiles tiles: per_sm (default _GPU_PROGRAMS_PER_SM)
    a streaming multiprocessor, _INTERPRETER_PROGRAMS under the interpreter; at most one a tile."""
    if _interpreting(device):
        cap = _INTERPRETER_PROGRAMS
    else:
        cap = (per_sm or _GPU_PROGRAMS_PER_SM) * sm_count(device)
    return max(1, min(num_tiles, cap))


def sum_partial_rows(partials: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [D] (out's float dtype) = partials [P, D] (fp32, contiguous) summed over its P rows, one
    launch; the same bits every run for a given P (see `_sum_partial_rows_kernel`)."""
    P, D = partials.shape
    block_p, block_d = min(_PARTIAL_ROWS, next_pow2(P)), min(_PARTIAL_COLS, next_pow2(D))
    _sum_partial_rows_kernel[(triton.cdiv(D, block_d),)](partials, out, P, D, BLOCK_P=block_p, BLOCK_D=block_d,
                                                         num_warps=4)
    return out


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


# lint: allow-function TP001 -- [P, 32] fp32 partial rows (2 MB at P = 132, D = 4096), read once: a descriptor per launch would cost host time for a load that is latency bound
@triton.jit
def _sum_partial_rows_kernel(part_ptr, out_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[c] = sum over p < P of part[p, c] for this program's BLOCK_D columns (grid
    (cdiv(D, BLOCK_D),)), stored in out's dtype. Explicit: the order of the sum, [BLOCK_P, BLOCK_D]
    blocks of partial rows added elementwise in row order, then one reduction over the block's
    rows (fixed by the compiled layout), so a weight gradient has the same bits every run."""
    cols = tl.program_id(0) * BLOCK_D + tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_D), BLOCK_D), BLOCK_D)
    rows = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        r = p0 + rows
        acc += tl.load(part_ptr + r.to(tl.int64)[:, None] * D + cols[None, :],
                       mask=(r < P)[:, None] & (cols < D)[None, :], other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < D)
