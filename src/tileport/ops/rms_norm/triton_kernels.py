"""RMSNorm, Triton backend: one forward and one backward launch (plus a column sum for d weight).

Per row of x [M, D] (fp32 math, any input dtype):
    rstd = rsqrt(sum(x^2) / D + eps);  y = x * rstd * w
    g = dy * w;  dx = rstd * g - x * (rstd^3 * sum(g * x) / D);  dw = sum_rows dy * x * rstd

Design (bandwidth bound: forward moves 2*M*D elements, backward 3*M*D):
- A program owns BLOCK_M whole rows. When next_pow2(D) <= _MAX_TILE_D the row tile stays in
  registers (ONE_TILE): one read of each input. Wider rows are walked in column chunks of
  BLOCK_D: a first pass forms the row sums, a second re-reads the chunks (hot in L2) and writes.
- 2D tiles move through tensor descriptors (`tl.make_tensor_descriptor`, TMA on Hopper) when the
  base pointers and row strides are 16-byte aligned; otherwise (or before sm_90) through masked
  raw pointers. Out-of-range rows and columns read as 0 either way, which every formula here
  tolerates (a zero row gives rstd = rsqrt(eps), finite, and is never stored).
- Backward programs are persistent: each loops over row tiles and keeps its d weight partial sum
  in registers (ONE_TILE), or read-modify-writes its own fp32 row of `partials` (chunked; a
  barrier per tile orders those accesses inside the CTA). `partials [P, D]` is summed on the host.

`ensure_descriptor_allocator`, `descriptors_fit`, `row_config`, `_load_rows` and `_store_rows`
are shared with the softmax kernels.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tileport.memory import new_empty

# Tuning knobs (module constants so that a GPU sweep, or a test, can patch them).
_MAX_TILE_D = 16384  # widest row held in registers whole; wider rows are chunked
_MAX_TILE_D_BWD = 8192  # same for the backward (x, dy, w live together: at D = 16384 fp32 the
#                         sm_90a build of the one-tile backward used 128 registers and spilled)
_CHUNK_D = 4096  # chunk width for wider rows (capped by _MAX_TILE_D)
_GPU_TILE_ELEMS = 4096  # target BLOCK_M * BLOCK_D on a GPU
_INTERPRETER_TILE_ELEMS = 1 << 14  # under TRITON_INTERPRET: few, large programs
_MAX_BLOCK_M = 256  # a TMA box dimension is at most 256
_PREFER_DESCRIPTORS = True  # set False to measure the raw-pointer path on sm_90
_GPU_PROGRAMS_PER_SM = 4  # persistent backward programs per SM
_INTERPRETER_PROGRAMS = 2
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------
# host helpers (shared with softmax)
# ----------------------------------------------------------------------------------------


def _interpreting(device: torch.device) -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1" or device.type == "cpu"


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
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
            return False
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if (t.stride(0) * t.element_size()) % 16:  # checked even for one row: it is passed
            return False
    return True


def row_config(M: int, D: int, device: torch.device, max_tile_d: int) -> dict:
    """BLOCK_M, BLOCK_D, ONE_TILE and num_warps for M rows of width D."""
    full = max(16, triton.next_power_of_2(D))
    if full <= max_tile_d:
        block_d, one_tile = full, True
    else:
        block_d, one_tile = max(16, min(_CHUNK_D, max_tile_d)), False  # max_tile_d: a power of two
    tile = _INTERPRETER_TILE_ELEMS if _interpreting(device) else _GPU_TILE_ELEMS
    block_m = max(1, min(tile // block_d, triton.next_power_of_2(max(M, 1)), _MAX_BLOCK_M))
    elems = block_m * block_d
    num_warps = 4 if elems <= 2048 else (8 if elems <= 8192 else 16)
    return dict(BLOCK_M=block_m, BLOCK_D=block_d, ONE_TILE=one_tile, num_warps=num_warps)


def persistent_programs(num_tiles: int, device: torch.device) -> int:
    if _interpreting(device):
        cap = _INTERPRETER_PROGRAMS
    else:
        cap = _GPU_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(num_tiles, cap))


def triton_refusal(D: int, dtype, weight_dtype) -> str | None:
    if dtype not in _SUPPORTED_DTYPES:
        return f"x dtype {dtype} is not one of float32, float16, bfloat16"
    if weight_dtype is not None and weight_dtype not in _SUPPORTED_DTYPES:
        return f"weight dtype {weight_dtype} is not one of float32, float16, bfloat16"
    return None


# ----------------------------------------------------------------------------------------
# device helpers (shared with softmax)
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


# ----------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, M, D, stride_x, stride_y, eps,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ONE_TILE: tl.constexpr,
    USE_DESC: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):
    row0 = tl.program_id(0) * BLOCK_M
    x_src = _make_rows_desc(x_ptr, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
    y_dst = _make_rows_desc(y_ptr, M, D, stride_y, BLOCK_M, BLOCK_D, USE_DESC)
    if ONE_TILE:
        x = _load_rows(x_src, row0, 0, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        y = x * rstd[:, None]
        if HAS_WEIGHT:
            y = y * _load_vec(w_ptr, 0, D, BLOCK_D)[None, :]
        _store_rows(y_dst, row0, 0, y, M, D, stride_y, BLOCK_M, BLOCK_D, USE_DESC)
    else:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in range(0, D, BLOCK_D):
            x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
            ss += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(ss / D + eps)
        for c in range(0, D, BLOCK_D):
            x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
            y = x * rstd[:, None]
            if HAS_WEIGHT:
                y = y * _load_vec(w_ptr, c, D, BLOCK_D)[None, :]
            _store_rows(y_dst, row0, c, y, M, D, stride_y, BLOCK_M, BLOCK_D, USE_DESC)


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, dw_part_ptr, M, D, stride_x, stride_dy, stride_dx, eps, num_tiles,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ONE_TILE: tl.constexpr,
    USE_DESC: tl.constexpr, HAS_WEIGHT: tl.constexpr, WANT_DW: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    x_src = _make_rows_desc(x_ptr, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
    dy_src = _make_rows_desc(dy_ptr, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
    dx_dst = _make_rows_desc(dx_ptr, M, D, stride_dx, BLOCK_M, BLOCK_D, USE_DESC)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_D), BLOCK_D), BLOCK_D)
    part_row = dw_part_ptr + pid.to(tl.int64) * D
    if ONE_TILE:
        if HAS_WEIGHT:
            w = _load_vec(w_ptr, 0, D, BLOCK_D)
        dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for tile in range(pid, num_tiles, nprog):
            row0 = tile * BLOCK_M
            x = _load_rows(x_src, row0, 0, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
            dy = _load_rows(dy_src, row0, 0, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
            if HAS_WEIGHT:
                g = dy * w[None, :]
            else:
                g = dy
            coef = tl.sum(g * x, axis=1) * (rstd * rstd * rstd) / D
            dx = g * rstd[:, None] - x * coef[:, None]
            _store_rows(dx_dst, row0, 0, dx, M, D, stride_dx, BLOCK_M, BLOCK_D, USE_DESC)
            if WANT_DW:
                dw_acc += tl.sum(dy * x * rstd[:, None], axis=0)
        if WANT_DW:
            tl.store(part_row + cols, dw_acc, mask=cols < D)
    else:
        if WANT_DW:
            for c in range(0, D, BLOCK_D):
                tl.store(part_row + c + cols, tl.zeros([BLOCK_D], dtype=tl.float32), mask=c + cols < D)
            tl.debug_barrier()
        for tile in range(pid, num_tiles, nprog):
            row0 = tile * BLOCK_M
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            gx = tl.zeros([BLOCK_M], dtype=tl.float32)
            for c in range(0, D, BLOCK_D):
                x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
                g = _load_rows(dy_src, row0, c, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
                if HAS_WEIGHT:
                    g = g * _load_vec(w_ptr, c, D, BLOCK_D)[None, :]
                ss += tl.sum(x * x, axis=1)
                gx += tl.sum(g * x, axis=1)
            rstd = tl.rsqrt(ss / D + eps)
            coef = gx * (rstd * rstd * rstd) / D
            for c in range(0, D, BLOCK_D):
                x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
                dy = _load_rows(dy_src, row0, c, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
                if HAS_WEIGHT:
                    g = dy * _load_vec(w_ptr, c, D, BLOCK_D)[None, :]
                else:
                    g = dy
                dx = g * rstd[:, None] - x * coef[:, None]
                _store_rows(dx_dst, row0, c, dx, M, D, stride_dx, BLOCK_M, BLOCK_D, USE_DESC)
                if WANT_DW:
                    pmask = c + cols < D
                    part = tl.load(part_row + c + cols, mask=pmask, other=0.0)
                    tl.store(part_row + c + cols, part + tl.sum(dy * x * rstd[:, None], axis=0), mask=pmask)
            if WANT_DW:
                tl.debug_barrier()  # this tile's partial-row writes before the next tile's reads


# ----------------------------------------------------------------------------------------
# stages (one launch each)
# ----------------------------------------------------------------------------------------


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[M, D] view with unit last stride (a copy only when the last stride is not 1)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_forward_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y with x's shape and dtype. x [..., D], weight [D] or None."""
    D = x.shape[-1]
    x2 = _rows(x)
    M = x2.shape[0]
    y = new_empty((M, D), x.dtype, x.device)
    cfg = row_config(M, D, x.device, _MAX_TILE_D)
    use_desc = descriptors_fit([x2, y], x.device)
    if use_desc:
        ensure_descriptor_allocator()
    w = weight.contiguous() if weight is not None else x2
    grid = (triton.cdiv(M, cfg["BLOCK_M"]),)
    _rms_norm_fwd_kernel[grid](
        x2, w, y, M, D, x2.stride(0), y.stride(0), eps,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"], ONE_TILE=cfg["ONE_TILE"],
        USE_DESC=use_desc, HAS_WEIGHT=weight is not None, num_warps=cfg["num_warps"],
    )
    return y.view(x.shape)


def rms_norm_backward_triton(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                             want_dw: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx with x's shape and dtype, d weight in weight's dtype or None)."""
    D = x.shape[-1]
    x2 = _rows(x)
    dy2 = _rows(grad_y)
    M = x2.shape[0]
    dx = new_empty((M, D), x.dtype, x.device)
    cfg = row_config(M, D, x.device, min(_MAX_TILE_D, _MAX_TILE_D_BWD))
    num_tiles = triton.cdiv(M, cfg["BLOCK_M"])
    P = persistent_programs(num_tiles, x.device)
    want_dw = want_dw and weight is not None
    partials = new_empty((P, D), torch.float32, x.device) if want_dw else dx
    use_desc = descriptors_fit([x2, dy2, dx], x.device)
    if use_desc:
        ensure_descriptor_allocator()
    w = weight.contiguous() if weight is not None else x2
    _rms_norm_bwd_kernel[(P,)](
        x2, w, dy2, dx, partials, M, D, x2.stride(0), dy2.stride(0), dx.stride(0), eps, num_tiles,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"], ONE_TILE=cfg["ONE_TILE"],
        USE_DESC=use_desc, HAS_WEIGHT=weight is not None, WANT_DW=want_dw, num_warps=cfg["num_warps"],
    )
    dw = partials.sum(dim=0).to(weight.dtype) if want_dw else None
    return dx.view(x.shape), dw
