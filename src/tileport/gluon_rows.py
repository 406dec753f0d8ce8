"""Row streaming for the row-wise ops' Gluon kernels (rms_norm, softmax): a persistent program walks
its row tiles through a ring of TMA buffers, so that several tiles' loads are in flight on each SM
while it works on one. Shared machinery, never an op's math: each op's gluon_kernels.py writes its
kernel around these helpers (`ring_open`, `ring_take`, `ring_stop`, `row_tile_offsets`,
`row_vector`) and launches it through `row_stream_plan`.

A row tile is BM whole rows of x [M, D], seen as [M, NCB, CB] (D = NCB * CB, CB <= 256, both
powers of two): a TMA box is at most 256 elements a side, so a 3D descriptor with block
[BM, NCB, CB] brings a tile in with one copy. By default a tile is TILE_BYTES of rows with the
warps along NCB (a row of D > 256 spread over warps); a kernel can ask for rows inside warps
(`row_stream_plan(..., rows_in_warps=True)`: tiles of at least NUM_WARPS rows, the warps along BM),
which softmax's forward does so that its two row reductions never cross warps. Rows past M read as zero (TMA's padding); stores are
masked. Why Gluon here (docs/perf/llm_ops.md): the Triton row kernels reach 59-64% of the copy
bandwidth as kernels (RMSNorm and softmax forward at 8192 x 4096 on the H200), one tile per
program with the descriptor built in the kernel. The ring's depth, one persistent program per SM
and descriptors built on the host are the explicit control Triton does not give.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from tileport.devices import sm_count
from tileport.shapes import cdiv, next_pow2

try:  # the module must import on a CPU machine and without Gluon
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _GLUON_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the installed triton
    _GLUON_ERROR = f"triton.experimental.gluon is unavailable ({type(exc).__name__}: {exc})"

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_D = 8192  # widest row a tile holds in registers (BM >= 1 rows of fp32 math)
# Switches read at each launch (module constants, so a GPU sweep or a test can patch them):
TILE_BYTES = 32 * 1024  # one ring buffer: BM rows of D elements
STAGES = 4  # ring depth: 128 KB of shared memory, one program per SM
NUM_WARPS = 8
# A kernel that asks for rows inside warps (`row_stream_plan(..., rows_in_warps=True)`, softmax's
# forward) gets tiles of at least NUM_WARPS rows, one warp per row, where a ring of WARP_ROWS_STAGES
# such tiles fits: at D = 4096 bf16, 3 buffers of 64 KB (more bytes in flight than 4 of 32 KB).
WARP_ROWS_STAGES = 3


def rows_refusal(D: int, dtype: torch.dtype) -> str | None:
    """Why the row-streaming Gluon kernels can't take rows of D elements of `dtype` (None if they can)."""
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    if dtype not in _DTYPES:
        return f"x dtype {dtype} is not one of float32, float16, bfloat16"
    smallest = 32 // dtype.itemsize
    if D != next_pow2(D) or not smallest <= D <= MAX_D:
        return (f"D={D}: the Gluon row kernels take powers of two from {smallest} to {MAX_D} (one TMA box "
                f"per row tile); Triton's kernels take the others")
    return None


def rows_aligned(t2: torch.Tensor) -> bool:
    """Whether [M, D] rows can be TMA'd: 16-byte aligned base and row stride, unit last stride, rows
    apart (an expanded view's row stride 0 makes no tensor map)."""
    return (t2.stride(-1) == 1 and t2.data_ptr() % 16 == 0 and (t2.stride(0) * t2.element_size()) % 16 == 0
            and t2.stride(0) >= t2.shape[1])


@dataclasses.dataclass(frozen=True)
class RowStreamPlan:
    """A launch of a row-streaming kernel over x [M, D]: the descriptor, the tile's register layout
    (a constexpr argument), the tile count and the persistent grid."""

    desc: object
    layout: object
    n_tiles: int
    programs: int
    stages: int  # the ring's depth (a constexpr argument)
    rows_in_warps: bool = False  # whether the layout keeps every row inside one warp (no warps along NCB)


_SMEM_BUDGET = 200 * 1024  # of the 227 KB a CTA has on sm_90, leaving the compiler's scratch


def _check_ring_switches() -> None:
    if STAGES < 1 or STAGES * TILE_BYTES > _SMEM_BUDGET or WARP_ROWS_STAGES < 1:
        raise ValueError(f"gluon_rows: STAGES {STAGES} x TILE_BYTES {TILE_BYTES} must be 1 to 200 KB of shared memory "
                         f"(227 KB a CTA on sm_90, with the compiler's scratch); WARP_ROWS_STAGES >= 1")


def _warp_rows_fit(D: int, itemsize: int) -> bool:
    """Whether a ring of WARP_ROWS_STAGES tiles of NUM_WARPS rows fits (rows of up to 8 KB:
    bf16/fp16 D <= 4096, fp32 D <= 2048)."""
    return WARP_ROWS_STAGES * max(TILE_BYTES, NUM_WARPS * D * itemsize) <= _SMEM_BUDGET


def _ring_shape(M: int, D: int, itemsize: int, rows_in_warps: bool) -> tuple[int, int, int, int, bool]:
    """(BM, NCB, CB, stages, warps along rows) of a row tile of x [M, D]. By default BM rows make
    TILE_BYTES and STAGES buffers ring; with rows_in_warps, where `_warp_rows_fit`, at least
    NUM_WARPS rows (the tile grows past TILE_BYTES only for rows wider than TILE_BYTES / NUM_WARPS,
    and its ring is then WARP_ROWS_STAGES deep)."""
    CB = min(D, 256)
    warp_rows = rows_in_warps and _warp_rows_fit(D, itemsize)
    rows = TILE_BYTES // (D * itemsize)
    if warp_rows:
        rows = max(rows, NUM_WARPS)
    BM = max(1, min(256, rows, next_pow2(M)))
    stages = WARP_ROWS_STAGES if warp_rows and rows * D * itemsize > TILE_BYTES else STAGES
    return BM, D // CB, CB, stages, warp_rows


@functools.lru_cache(maxsize=None)
def _tile_layout(BM: int, NCB: int, CB: int, itemsize: int, num_warps: int, warps_along_rows: bool = False):
    """[BM, NCB, CB] over the warps: 16-byte vectors along CB, a warp's lanes along CB first, the
    warps along NCB first (so a row's reduction crosses warps only when D > 256), or, with
    warps_along_rows, along BM only (every row inside one warp: its reductions are the thread's
    registers and warp shuffles, never shared memory)."""
    vec = 16 // itemsize
    tc = min(32, CB // vec)
    tj = min(32 // tc, NCB)
    tm = 32 // (tc * tj)
    wj = 1 if warps_along_rows else min(num_warps, max(1, NCB // tj))
    return gl.BlockedLayout([1, 1, vec], [tm, tj, tc], [num_warps // wj, wj, 1], [2, 1, 0])


@functools.lru_cache(maxsize=None)
def _smem_layout(dtype: torch.dtype):
    # unswizzled: the tile goes to registers in 16-byte vectors along rows, which hit distinct banks
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * dtype.itemsize, rank=3)


def row_stream_plan(x2: torch.Tensor, rows_in_warps: bool = False) -> RowStreamPlan:
    """The plan for x2 [M, D] (`rows_refusal` and `rows_aligned` passed); rows_in_warps: see
    `_ring_shape` (softmax's forward; RMSNorm's keeps the default). Layouts are built once per
    shape class (building one costs ~15 us of host time: gdn/gluon_kernels.py, `_smem_layout`)."""
    _check_ring_switches()
    M, D = x2.shape
    BM, NCB, CB, stages, warp_rows = _ring_shape(M, D, x2.element_size(), rows_in_warps)
    desc = TensorDescriptor(x2, [M, NCB, CB], [x2.stride(0), CB, 1], [BM, NCB, CB], _smem_layout(x2.dtype))
    n_tiles = cdiv(M, BM)
    return RowStreamPlan(desc, _tile_layout(BM, NCB, CB, x2.element_size(), NUM_WARPS, warp_rows), n_tiles,
                         min(n_tiles, sm_count(x2.device)), stages, warp_rows)


def descriptor_stand_in_for(M: int, D: int, dtype: torch.dtype, rows_in_warps: bool = False) -> RowStreamPlan:
    """`row_stream_plan`'s plan for compile checks (no GPU): a descriptor stand-in, 132 programs."""
    from tileport.compile_check import descriptor_stand_in

    BM, NCB, CB, stages, warp_rows = _ring_shape(M, D, dtype.itemsize, rows_in_warps)
    desc = descriptor_stand_in([M, NCB, CB], dtype, [BM, NCB, CB], _smem_layout(dtype), strides=[D, CB, 1])
    n_tiles = cdiv(M, BM)
    return RowStreamPlan(desc, _tile_layout(BM, NCB, CB, dtype.itemsize, NUM_WARPS, warp_rows), n_tiles,
                         min(n_tiles, 132), stages, warp_rows)


if _GLUON_ERROR is None:

    @gluon.jit
    def _issue_row_tile(desc, tile, bar, buf, pred):
        """TMA row tile `tile` of desc into buf on bar, armed with its bytes; nothing when not pred."""
        BM: gl.constexpr = desc.block_type.shape[0]
        mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(desc, [tile * BM, 0, 0], bar, buf, pred=pred)

    @gluon.jit
    def ring_open(desc, n_tiles, STAGES: gl.constexpr):
        """The ring of this program (pid of P, taking tiles pid, pid + P, ...: my_n of them):
        STAGES shared buffers of desc's block and their barriers, initialised, and the loads of
        its first STAGES tiles issued. Returns (bufs, bars, pid, P, my_n)."""
        bufs = gl.allocate_shared_memory(desc.dtype, [STAGES] + desc.block_type.shape, desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        my_n = (n_tiles - pid + P - 1) // P
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        for s in gl.static_range(STAGES):
            _issue_row_tile(desc, pid + s * P, bars.index(s), bufs.index(s), s < my_n)
        return bufs, bars, pid, P, my_n

    @gluon.jit
    def ring_take(desc, bufs, bars, i, pid, P, my_n, layout: gl.constexpr):
        """This program's step-i tile in registers (in `layout`, fp32); its buffer is refilled with
        the tile of step i + STAGES before the caller works on this one."""
        STAGES: gl.constexpr = bufs.shape[0]
        s = i % STAGES
        mbarrier.wait(bars.index(s), (i // STAGES) & 1)
        x = bufs.index(s).load(layout).to(gl.float32)
        gl.thread_barrier()  # every warp has read buffer s before its refill
        _issue_row_tile(desc, pid + (i + STAGES) * P, bars.index(s), bufs.index(s), i + STAGES < my_n)
        return x

    @gluon.jit
    def ring_stop(bars):
        STAGES: gl.constexpr = bars.shape[0]
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

    @gluon.jit
    def row_tile_offsets(tile, M, row_stride, BM: gl.constexpr, NCB: gl.constexpr, CB: gl.constexpr,
                         layout: gl.constexpr):
        """(offsets [BM, NCB, CB] of row tile `tile`'s elements in a [M, D] tensor of row stride
        row_stride, row mask [BM, 1, 1])."""
        r = gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
        j = gl.arange(0, NCB, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        c = gl.arange(0, CB, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        rows = gl.expand_dims(gl.expand_dims(tile * BM + r, 1), 2)
        cols = gl.expand_dims(gl.expand_dims(j, 0), 2) * CB + gl.expand_dims(gl.expand_dims(c, 0), 1)
        return rows.to(gl.int64) * row_stride + cols, rows < M

    @gluon.jit
    def row_vector(ptr, NCB: gl.constexpr, CB: gl.constexpr, layout: gl.constexpr):
        """A [D] vector (D = NCB * CB) as [1, NCB, CB] in `layout`, fp32: a weight every row shares."""
        j = gl.arange(0, NCB, layout=gl.SliceLayout(1, gl.SliceLayout(0, layout)))
        c = gl.arange(0, CB, layout=gl.SliceLayout(0, gl.SliceLayout(0, layout)))
        return gl.expand_dims(gl.load(ptr + gl.expand_dims(j, 1) * CB + gl.expand_dims(c, 0)).to(gl.float32), 0)

    @gluon.jit
    def row_sums(x):
        """[BM, NCB, CB] -> [BM, 1, 1]: each row's sum, broadcastable against the tile."""
        return gl.expand_dims(gl.expand_dims(gl.sum(gl.sum(x, axis=2), axis=1), 1), 2)

    @gluon.jit
    def row_maxes(x):
        """[BM, NCB, CB] -> [BM, 1, 1]: each row's max."""
        return gl.expand_dims(gl.expand_dims(gl.max(gl.max(x, axis=2), axis=1), 1), 2)
