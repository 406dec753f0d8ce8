"""Row streaming for the row-wise ops' Gluon kernels (rms_norm, softmax): a persistent program walks
its row tiles through a ring of TMA buffers, so that several tiles' loads are in flight on each SM
while it works on one. Shared machinery, never an op's math: each op's gluon_kernels.py writes its
kernel around these helpers (`ring_open`, `ring_take`, `ring_stop`, `row_tile_offsets`,
`row_vector`) and launches it through `row_stream_plan`. A backward reading two inputs row by row
(x and dy) uses the same ring with a tile of each per slot (`pair_ring_open`, `pair_ring_take`,
`pair_stream_plan`; one mbarrier a slot armed with both tiles' bytes), and sums per-program partial
rows (a weight gradient) with `sum_partial_rows`.

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
# The paired ring of the backwards (`pair_stream_plan`: x and dy read together, tile by tile): each
# slot holds PAIR_TILE_BYTES of rows of both, PAIR_STAGES slots (16 KB x 2 x 4 = 128 KB at every
# D the pair's rows fit in a 16 KB tile: the bytes the forward's ring keeps in flight, and two fp32
# tiles plus the weight gradient's accumulator in registers without spills). Rows wider than
# PAIR_TILE_BYTES (fp32 D = 8192) take one row a tile and as many slots as fit the budget (3).
# Untimed on the H200 (docs/perf/llm_ops.md row 9); scripts/rows_backward_ab.py also times 16 KB x 6
# (192 KB; 32 KB x 3 would spill: 336 bytes in RMSNorm's backward at 4096 bf16, 255 registers).
PAIR_TILE_BYTES = 16 * 1024
PAIR_STAGES = 4


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
    if PAIR_STAGES < 1 or 2 * PAIR_TILE_BYTES > _SMEM_BUDGET:
        raise ValueError(f"gluon_rows: PAIR_STAGES {PAIR_STAGES} >= 1, and a slot of two PAIR_TILE_BYTES "
                         f"{PAIR_TILE_BYTES} tiles within 200 KB of shared memory")


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


def shaped_row_plan(x2, BM: int, stages: int, num_warps: int, programs_per_sm: int,
                    warps_along_rows: bool = False) -> RowStreamPlan:
    """A plan of a shape the caller chose, beside `row_stream_plan`'s (the forwards' forms with
    several programs an SM): tiles of BM rows in a ring of `stages`, the tile's layout over
    num_warps warps (along rows with warps_along_rows), grid min(tiles, programs_per_sm x SMs).
    x2: [M, D] (checked as for `row_stream_plan`), or (M, D, dtype) for descriptor stand-ins
    (compile checks; 132 SMs)."""
    if isinstance(x2, tuple):
        from tileport.compile_check import descriptor_stand_in

        M, D, dtype = x2
        CB = min(D, 256)
        desc = descriptor_stand_in([M, D // CB, CB], dtype, [BM, D // CB, CB], _smem_layout(dtype), strides=[D, CB, 1])
        sms = 132
    else:
        (M, D), dtype = x2.shape, x2.dtype
        CB = min(D, 256)
        desc = TensorDescriptor(x2, [M, D // CB, CB], [x2.stride(0), CB, 1], [BM, D // CB, CB], _smem_layout(dtype))
        sms = sm_count(x2.device)
    n_tiles = cdiv(M, BM)
    layout = _tile_layout(BM, D // CB, CB, dtype.itemsize, num_warps, warps_along_rows)
    return RowStreamPlan(desc, layout, n_tiles, min(n_tiles, programs_per_sm * sms), stages, warps_along_rows)


@dataclasses.dataclass(frozen=True)
class PairStreamPlan:
    """A launch of a kernel reading two [M, D] inputs row tile by row tile (`pair_ring_open`): their
    descriptors (same block), the tile's register layout, the tile count, the persistent grid and
    the ring's depth."""

    a_desc: object
    b_desc: object
    layout: object
    n_tiles: int
    programs: int
    stages: int


def _pair_ring_shape(M: int, D: int, itemsize: int) -> tuple[int, int, int, int]:
    """(BM, NCB, CB, stages) of the paired ring: BM rows make PAIR_TILE_BYTES (at least one row),
    and PAIR_STAGES slots of two such tiles, fewer where they would pass the shared-memory budget."""
    CB = min(D, 256)
    BM = max(1, min(256, PAIR_TILE_BYTES // (D * itemsize), next_pow2(M)))
    stages = max(1, min(PAIR_STAGES, _SMEM_BUDGET // (2 * BM * D * itemsize)))
    return BM, D // CB, CB, stages


def pair_stream_plan(a2: torch.Tensor, b2: torch.Tensor) -> PairStreamPlan:
    """The plan for two [M, D] inputs of one dtype (`rows_refusal` and `rows_aligned` passed for both;
    their row strides may differ). The tile's layout is the default one (warps along a row's
    256-element chunks): a tile of rows inside warps would be 8 rows, 64 KB a tensor at D = 4096
    bf16, and two of them leave room for one slot only."""
    _check_ring_switches()
    M, D = a2.shape
    assert b2.shape == a2.shape and b2.dtype == a2.dtype, (a2.shape, a2.dtype, b2.shape, b2.dtype)
    BM, NCB, CB, stages = _pair_ring_shape(M, D, a2.element_size())
    layout = _smem_layout(a2.dtype)
    # zero padding (the default, named): rows past M arrive as zeros, so the backwards' sums over
    # rows (rms_norm's dw) add 0 for them (with eps > 0, which the ops check)
    a_desc = TensorDescriptor(a2, [M, NCB, CB], [a2.stride(0), CB, 1], [BM, NCB, CB], layout, padding="zero")
    b_desc = TensorDescriptor(b2, [M, NCB, CB], [b2.stride(0), CB, 1], [BM, NCB, CB], layout, padding="zero")
    n_tiles = cdiv(M, BM)
    return PairStreamPlan(a_desc, b_desc, _tile_layout(BM, NCB, CB, a2.element_size(), NUM_WARPS), n_tiles,
                          min(n_tiles, sm_count(a2.device)), stages)


def backward_pair_plan(x: torch.Tensor, grad_y: torch.Tensor):
    """(plan, x2, dx [M, D] in x's dtype) for a row-wise backward that streams x and grad_y as row
    pairs (`pair_stream_plan`), or None where TMA can't read either (the caller runs Triton's)."""
    from tileport.memory import as_rows, new_empty

    x2, dy2 = as_rows(x), as_rows(grad_y)
    if not (rows_aligned(x2) and rows_aligned(dy2)):
        return None
    return pair_stream_plan(x2, dy2), x2, new_empty(tuple(x2.shape), x.dtype, x.device)


def pair_descriptor_stand_in_for(M: int, D: int, dtype: torch.dtype) -> PairStreamPlan:
    """`pair_stream_plan`'s plan for compile checks (no GPU): descriptor stand-ins, 132 programs."""
    from tileport.compile_check import descriptor_stand_in

    BM, NCB, CB, stages = _pair_ring_shape(M, D, dtype.itemsize)
    a, b = (descriptor_stand_in([M, NCB, CB], dtype, [BM, NCB, CB], _smem_layout(dtype), strides=[D, CB, 1])
            for _ in range(2))
    n_tiles = cdiv(M, BM)
    return PairStreamPlan(a, b, _tile_layout(BM, NCB, CB, dtype.itemsize, NUM_WARPS), n_tiles, min(n_tiles, 132),
                          stages)


# The sum of a [P, D] fp32 buffer of per-program partial rows (a weight gradient's) over its rows,
# in a fixed order (the same bits every run on a device: P is its SM count): programs of
# PARTIAL_COLS columns each, all P rows of them in one masked load when P <= 256.
PARTIAL_COLS = 32
_PARTIAL_WARPS = 4


@functools.lru_cache(maxsize=None)
def _partials_layout(BP: int, BD: int):
    """[BP, BD] fp32 over _PARTIAL_WARPS warps: 16-byte vectors along a partial row, the lanes on
    BD // 4 columns and the rest of the warp and the warps on rows."""
    tc = min(32, BD // 4) if BD >= 4 else 1
    return gl.BlockedLayout([1, min(4, BD)], [32 // tc, tc], [_PARTIAL_WARPS, 1], [1, 0])


def _partials_shape(P: int, D: int) -> tuple[int, int]:
    return min(256, next_pow2(P)), min(next_pow2(D), PARTIAL_COLS)  # a power of two: the mask takes D's tail


def sum_partial_rows(partials: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [D] (any float dtype) = partials [P, D] fp32 summed over its P rows, one launch."""
    P, D = partials.shape
    BP, BD = _partials_shape(P, D)
    _sum_partial_rows_kernel[(cdiv(D, BD),)](partials, out, P, D, BP, BD, _partials_layout(BP, BD),
                                             num_warps=_PARTIAL_WARPS)
    return out


def partial_rows_compile_args(P: int, D: int, out_dtype: torch.dtype) -> dict:
    """`_sum_partial_rows_kernel`'s arguments for a compile check (stand-ins, no GPU)."""
    from tileport.compile_check import TensorStandIn

    BP, BD = _partials_shape(P, D)
    return dict(part_ptr=TensorStandIn([P, D], torch.float32), out_ptr=TensorStandIn([D], out_dtype), P=P, D=D,
                BP=BP, BD=BD, L=_partials_layout(BP, BD))


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
    def _issue_row_tiles(a_desc, b_desc, tile, bar, abuf, bbuf, pred, PAIRED: gl.constexpr):
        """TMA row tile `tile` of a_desc into abuf (and, PAIRED, of b_desc into bbuf) on bar, armed
        with all their bytes (one barrier completes when both tiles have landed); nothing when not pred."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        if PAIRED:
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
        else:
            mbarrier.expect(bar, a_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [tile * BM, 0, 0], bar, abuf, pred=pred)
        if PAIRED:
            tma.async_copy_global_to_shared(b_desc, [tile * BM, 0, 0], bar, bbuf, pred=pred)

    @gluon.jit
    def _ring_open(a_desc, b_desc, n_tiles, STAGES: gl.constexpr, PAIRED: gl.constexpr):
        """The ring itself, of single tiles (a_desc's; b_desc is a_desc and unused) or of paired
        ones (a tile of a_desc and the same rows of b_desc per slot, one barrier for both): what
        `ring_open` and `pair_ring_open` share. Returns (abufs, bbufs, bars, pid, P, my_n)."""
        abufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        if PAIRED:
            bbufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        else:
            bbufs = abufs
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        my_n = (n_tiles - pid + P - 1) // P
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        for s in gl.static_range(STAGES):
            _issue_row_tiles(a_desc, b_desc, pid + s * P, bars.index(s), abufs.index(s), bbufs.index(s), s < my_n,
                             PAIRED)
        return abufs, bbufs, bars, pid, P, my_n

    @gluon.jit
    def _ring_take(a_desc, b_desc, abufs, bbufs, bars, i, pid, P, my_n, layout: gl.constexpr, PAIRED: gl.constexpr):
        """Step i's tile (and, PAIRED, its partner) in registers, fp32; the slot is refilled with the
        step i + STAGES tiles before the caller works on these."""
        STAGES: gl.constexpr = abufs.shape[0]
        s = i % STAGES
        mbarrier.wait(bars.index(s), (i // STAGES) & 1)
        a = abufs.index(s).load(layout).to(gl.float32)
        if PAIRED:
            b = bbufs.index(s).load(layout).to(gl.float32)
        else:
            b = a
        gl.thread_barrier()  # every warp has read slot s before its refill
        _issue_row_tiles(a_desc, b_desc, pid + (i + STAGES) * P, bars.index(s), abufs.index(s), bbufs.index(s),
                         i + STAGES < my_n, PAIRED)
        return a, b

    @gluon.jit
    def ring_open(desc, n_tiles, STAGES: gl.constexpr):
        """The ring of this program (pid of P, taking tiles pid, pid + P, ...: my_n of them):
        STAGES shared buffers of desc's block and their barriers, initialised, and the loads of
        its first STAGES tiles issued. Returns (bufs, bars, pid, P, my_n)."""
        bufs, _unused, bars, pid, P, my_n = _ring_open(desc, desc, n_tiles, STAGES, False)
        return bufs, bars, pid, P, my_n

    @gluon.jit
    def ring_take(desc, bufs, bars, i, pid, P, my_n, layout: gl.constexpr):
        """This program's step-i tile in registers (in `layout`, fp32); its buffer is refilled with
        the tile of step i + STAGES before the caller works on this one."""
        x, _unused = _ring_take(desc, desc, bufs, bufs, bars, i, pid, P, my_n, layout, False)
        return x

    @gluon.jit
    def pair_ring_open(a_desc, b_desc, n_tiles, STAGES: gl.constexpr):
        """`ring_open` for two [M, D] inputs read row tile by row tile together (a backward's x and
        dy): each of the STAGES slots holds a tile of both, armed on one barrier. Returns
        (abufs, bbufs, bars, pid, P, my_n)."""
        return _ring_open(a_desc, b_desc, n_tiles, STAGES, True)

    @gluon.jit
    def pair_ring_take(a_desc, b_desc, abufs, bbufs, bars, i, pid, P, my_n, layout: gl.constexpr):
        """`ring_take` for the paired ring: (a, b), step i's tiles of both inputs in registers (fp32)."""
        return _ring_take(a_desc, b_desc, abufs, bbufs, bars, i, pid, P, my_n, layout, True)

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
    def row_vector_offsets(NCB: gl.constexpr, CB: gl.constexpr, layout: gl.constexpr):
        """The offsets 0 .. D - 1 (D = NCB * CB) as [NCB, CB] in SliceLayout(0, layout): where a [D]
        vector every row shares sits, and the layout of a tile's sum over its rows (axis 0)."""
        j = gl.arange(0, NCB, layout=gl.SliceLayout(1, gl.SliceLayout(0, layout)))
        c = gl.arange(0, CB, layout=gl.SliceLayout(0, gl.SliceLayout(0, layout)))
        return gl.expand_dims(j, 1) * CB + gl.expand_dims(c, 0)

    @gluon.jit
    def row_vector(ptr, NCB: gl.constexpr, CB: gl.constexpr, layout: gl.constexpr):
        """A [D] vector (D = NCB * CB) as [1, NCB, CB] in `layout`, fp32: a weight every row shares."""
        return gl.expand_dims(gl.load(ptr + row_vector_offsets(NCB, CB, layout)).to(gl.float32), 0)

    @gluon.jit
    def row_sums(x):
        """[BM, NCB, CB] -> [BM, 1, 1]: each row's sum, broadcastable against the tile."""
        return gl.expand_dims(gl.expand_dims(gl.sum(gl.sum(x, axis=2), axis=1), 1), 2)

    @gluon.jit
    def row_maxes(x):
        """[BM, NCB, CB] -> [BM, 1, 1]: each row's max."""
        return gl.expand_dims(gl.expand_dims(gl.max(gl.max(x, axis=2), axis=1), 1), 2)

    @gluon.jit
    def row_sum_pair(a, b):
        """[BM, NCB, CB] twice -> [BM, 1, 1] twice: each row's sum of a and of b, in one reduction
        (when a row spans warps, one round through shared memory for both, not one each)."""
        sa, sb = gl.reduce((a, b), 2, _add_pair)
        sa, sb = gl.reduce((sa, sb), 1, _add_pair)
        return (gl.expand_dims(gl.expand_dims(sa, 1), 2), gl.expand_dims(gl.expand_dims(sb, 1), 2))

    @gluon.jit
    def _add_pair(a1, b1, a2, b2):
        return a1 + a2, b1 + b2

    @gluon.jit
    def _sum_partial_rows_kernel(part_ptr, out_ptr, P, D, BP: gl.constexpr, BD: gl.constexpr, L: gl.constexpr):
        """out[c] = sum over p of part[p, c] for the columns c of this program's block (grid
        (cdiv(D, BD),)): blocks of [BP, BD] fp32 partial rows added elementwise, in row-block order,
        then reduced over rows once; stored in out's dtype. Explicit here (Triton would choose):
        the one-load-per-block shape for P <= BP (latency, not bandwidth: 2 MB at P = 132, D =
        4096) and a fixed summation order."""
        cols = gl.program_id(0) * BD + gl.arange(0, BD, layout=gl.SliceLayout(0, L))
        rows = gl.arange(0, BP, layout=gl.SliceLayout(1, L))
        acc = gl.zeros([BP, BD], gl.float32, L)
        for p0 in range(0, P, BP):
            r = gl.expand_dims(p0 + rows, 1)
            c = gl.expand_dims(cols, 0)
            # lint: allow TP001 -- P x D fp32 partials (2 MB at the standard shape), read once: a descriptor per launch costs host time for a latency-bound load
            acc += gl.load(part_ptr + r * D + c, mask=(r < P) & (c < D), other=0.0)
        gl.store(out_ptr + cols, gl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < D)
