"""Grouped GEMM, Gluon backend for Hopper (sm_90): the forward on a persistent, pipelined TMA +
WGMMA kernel; the backward is Triton's (triton_kernels.py).

c_i = a_i @ b_i for G groups (a_i [M_i, K], b_i [K, N], 16-bit, fp32 accumulation), written into
the stacked c [sum M_i, N]. Why Gluon here (docs/perf/llm_ops.md): Triton's kernel runs at 61% of
the card's matmul rate (1.067 ms at G = 8, M_i = 2048, K = N = 4096 against torch's loop of
matmuls at 0.844); what it leaves to the compiler is the pipeline (how many K steps are in flight
and when a buffer may be refilled) and the grid (one program per output tile). Here one program
per SM walks the output tiles in Triton's banded order, its K steps (tile after tile, the loads
running ahead across tiles) through a ring of STAGES (A, B) buffers with one asynchronous WGMMA
in flight behind the loads, and stores each tile by TMA through a half-tile staging buffer.
A second, warp-specialized form of the same forward (WARP_SPECIALIZED, llm_ops.md row 8) splits
the work into a TMA producer warp and two consumer warpgroups that meet only at mbarriers.
"""

from __future__ import annotations

import torch

from tileport.devices import sm_count
from tileport.memory import device_table, new_empty
from tileport.ops.grouped_gemm import triton_kernels
from tileport.shapes import cdiv
from tileport.triton_rows import ensure_descriptor_allocator

try:  # the module must import on a CPU machine and without Gluon
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    _GLUON_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the installed triton
    _GLUON_ERROR = f"triton.experimental.gluon is unavailable ({type(exc).__name__}: {exc})"

__all__ = ["gluon_refusal", "grouped_gemm_forward_gluon", "grouped_gemm_backward_gluon", "compile_cases"]

# The tile and the pipeline (read at each launch): BM = 128 rows on two warpgroups, BN = 256
# columns (the widest WGMMA), BK = 64; STAGES (A, B) buffers of 48 KB each; BAND row tiles per
# band (Triton's order: a band's A tiles stay in L2 while its group's B is read once per band).
# DESC_RING: slots per operand for the descriptors made on the device (3: a slot is rewritten
# three items after it was written, when every load through it has landed and its C stores have
# been read out; see the kernel). TMA_STORE: the epilogue through a 32 KB staging buffer and TMA
# (on), or row 4's masked register stores (off: the A/B of llm_ops.md row 5).
BM, BN, BK, STAGES, BAND, NUM_WARPS = 128, 256, 64, 4, 8, 8
DESC_RING, TMA_STORE = 3, True
# WARP_SPECIALIZED: the forward on `_grouped_gemm_fwd_ws_kernel` (llm_ops.md row 8: a 1-warp TMA
# producer and two consumer warpgroups, each owning 64 rows of the tile, synchronised by a full and
# an empty mbarrier per ring slot; no CTA barrier in the K loop) instead of the single-partition
# `_grouped_gemm_fwd_kernel` (rows 4-6). Off until the H200 has gated and timed it
# (scripts/grouped_gemm_ab.py times both). Same tile, ring, item order, tables and TMA_STORE switch.
# Registers: 4 warps launched (consumer warpgroup 0, the default partition) plus a consumer
# warpgroup and the producer warp, which Triton pads to a warpgroup: 12 warps, so at most
# 65536 / 384 = 170 registers a thread at launch (WS_MAXNREG, a multiple of 8); `setmaxnreg` then
# moves them: WS_PRODUCER_REGS to the producer's warpgroup, WS_CONSUMER_REGS to the worker
# consumer and what is left (3 * 168 - 40 - 232 = 232) to the default one. A consumer holds a
# 64 x 256 fp32 accumulator: 128 registers a thread.
WARP_SPECIALIZED = False
WS_MAXNREG, WS_CONSUMER_REGS, WS_PRODUCER_REGS = 168, 232, 40


def gluon_refusal(dtype: torch.dtype, b_dtype: torch.dtype) -> str | None:
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype}: the Gluon grouped GEMM takes bfloat16 and float16 (fp32 inputs multiply in full fp32 on Triton's)"
    if b_dtype != dtype:
        return f"b dtype {b_dtype} differs from a dtype {dtype}"
    return None


if _GLUON_ERROR is None:

    @gluon.jit
    def _tile_of(t, tiles_ptr, n_row_tiles, n_col, BM: gl.constexpr, BN: gl.constexpr, BAND: gl.constexpr):
        """(group, first row within the group, first column) of item t in Triton's banded order:
        BAND row tiles of the tile table at a time, every column tile of a band before the next."""
        per_band = BAND * n_col
        first = (t // per_band) * BAND
        rows_here = gl.minimum(n_row_tiles - first, BAND)
        r = first + (t % per_band) % rows_here
        n0 = ((t % per_band) // rows_here) * BN
        return gl.load(tiles_ptr + 2 * r), gl.load(tiles_ptr + 2 * r + 1) * BM, n0

    @gluon.jit
    def _group_ab_descs(table_ptr, g, N, K, dtype: gl.constexpr, A_SL: gl.constexpr, B_SL: gl.constexpr,
                        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
        """Group g's operand descriptors, made on the device from its table row (a, b addresses,
        first row in c, M_g): A [M_g, K] in [BM, BK] boxes and B [K, N] in [BK, BN] boxes (TMA
        zero-fills reads past M_g, K and N)."""
        a_ptr = gl.load(table_ptr + 4 * g).to(gl.pointer_type(dtype))
        b_ptr = gl.load(table_ptr + 4 * g + 1).to(gl.pointer_type(dtype))
        Mg = gl.load(table_ptr + 4 * g + 3).to(gl.int32)
        a_desc = tma.make_tensor_descriptor(a_ptr, [Mg, K], [K, 1], [BM, BK], A_SL)
        b_desc = tma.make_tensor_descriptor(b_ptr, [K, N], [N, 1], [BK, BN], B_SL)
        return a_desc, b_desc

    @gluon.jit
    def _group_c_desc(table_ptr, g, c_ptr, N, C_SL: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr):
        """Group g's rows of C [M_g, N] in [ROWS, COLS] boxes: TMA clips writes past M_g (a tile's
        rows past M_g belong to the next group) and past N."""
        c_row0 = gl.load(table_ptr + 4 * g + 2)
        Mg = gl.load(table_ptr + 4 * g + 3).to(gl.int32)
        return tma.make_tensor_descriptor(c_ptr + c_row0 * N, [Mg, N], [N, 1], [ROWS, COLS], C_SL)

    @gluon.jit
    def _group_descs(table_ptr, g, c_ptr, N, K, A_SL: gl.constexpr, B_SL: gl.constexpr, C_SL: gl.constexpr,
                     BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
        """Group g's TMA descriptors A, B and C (C in [BM, BN / 2] boxes, the single-partition
        kernel's half-tile epilogue)."""
        a_desc, b_desc = _group_ab_descs(table_ptr, g, N, K, c_ptr.dtype.element_ty, A_SL, B_SL, BM, BN, BK)
        c_desc = _group_c_desc(table_ptr, g, c_ptr, N, C_SL, BM, BN // 2)
        return a_desc, b_desc, c_desc

    @gluon.jit
    def _issue_k_step(a_desc, b_desc, m0, n0, kk, j, a_s, b_s, bars):
        """TMA K step kk of a tile (A [BM, BK] at (m0, kk BK), B [BK, BN] at (kk BK, n0)) into ring
        slot j % STAGES, on that slot's barrier."""
        STAGES: gl.constexpr = a_s.shape[0]
        BK: gl.constexpr = a_s.shape[2]
        slot = j % STAGES
        bar = bars.index(slot)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [m0, kk * BK], bar, a_s.index(slot))
        tma.async_copy_global_to_shared(b_desc, [kk * BK, n0], bar, b_s.index(slot))

    @gluon.jit
    def _prefetch(p, j, nk, has_next, a_d, b_d, m0, n0, a_n, b_n, m0n, n0n, a_s, b_s, bars):
        """K step p of the current tile into ring slot j % STAGES; p >= nk is the next tile's step
        p - nk (the loads run min(STAGES - 1, nk) steps ahead, so never past the next tile)."""
        if p < nk:
            _issue_k_step(a_d, b_d, m0, n0, p, j, a_s, b_s, bars)
        elif has_next:
            _issue_k_step(a_n, b_n, m0n, n0n, p - nk, j, a_s, b_s, bars)

    @gluon.jit
    def _mma_k_step(acc, j, a_s, b_s, bars, use_acc):
        """Wait for ring step j's loads, start its product asynchronously and retire the one before:
        after the CTA barrier, both warpgroups are done with step j - 1's slot, which may refill."""
        STAGES: gl.constexpr = a_s.shape[0]
        slot = j % STAGES
        mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
        acc = warpgroup_mma(a_s.index(slot), b_s.index(slot), acc, use_acc=use_acc, is_async=True)
        acc, _a, _b = warpgroup_mma_wait(1, deps=[acc, a_s.index(slot), b_s.index(slot)])
        gl.thread_barrier()  # the WGMMA race (TRITON-3.6-NOTES.md): the other warpgroup may still read the slot
        return acc

    @gluon.jit
    def _store_tile_tma(acc, c_desc, m0, n0, c_s):
        """The tile's [BM, BN] accumulator into C at (m0, n0) of its group's rows in two column
        halves through the [BM, BN / 2] staging buffer c_s; the second half's store is left in
        flight (the next use of c_s waits for it)."""
        BM: gl.constexpr = acc.shape[0]
        BN: gl.constexpr = acc.shape[1]
        # the halves are register subsets of the WGMMA layout (column bit 7 is a register bit): no data moves
        lo, hi = gl.split(gl.permute(gl.reshape(acc.to(c_desc.dtype), [BM, 2, BN // 2]), (0, 2, 1)))
        tma.store_wait(0)  # the last store has read c_s out: its issuing threads wait here, the barrier holds the rest
        gl.thread_barrier()
        c_s.store(lo)
        fence_async_shared()  # these shared stores before the TMA (async proxy) reads them
        gl.thread_barrier()
        tma.async_copy_shared_to_global(c_desc, [m0, n0], c_s)
        tma.store_wait(0)
        gl.thread_barrier()
        c_s.store(hi)
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(c_desc, [m0, n0 + BN // 2], c_s)

    @gluon.jit
    def _store_tile_masked(acc, c_ptr, table_ptr, g, m0, n0, N):
        """The tile's accumulator stored from the WGMMA layout with a row and a column mask (4-byte
        stores; rows past M_g belong to the next group): row 4's epilogue, kept for an A/B."""
        ACC_L: gl.constexpr = acc.type.layout
        c_row0 = gl.load(table_ptr + 4 * g + 2)
        Mg = gl.load(table_ptr + 4 * g + 3).to(gl.int32)
        rr = m0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, ACC_L))
        cc = n0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, ACC_L))
        offs = (c_row0 + rr).to(gl.int64)[:, None] * N + cc[None, :]
        # lint: allow TP001 -- row 4's masked epilogue, selectable beside the TMA store for an A/B (TMA_STORE)
        gl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=(rr < Mg)[:, None] & (cc < N)[None, :])

    @gluon.jit
    def _grouped_gemm_fwd_kernel(table_ptr, tiles_ptr, c_ptr, N, K, n_row_tiles, n_items,
                                 BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                                 BAND: gl.constexpr, DESC_RING: gl.constexpr, TMA_STORE: gl.constexpr):
        """C tiles [BM, BN] of the grouped product, items pid, pid + P, ... (item = a (row tile of
        the tile table, column tile) pair in Triton's banded order; grid (P,), one program per SM,
        2 warpgroups along M). The K steps of all of a program's items form one stream through a
        ring of STAGES (A, B) buffers: the loads run min(STAGES - 1, nk) steps ahead of one
        asynchronous WGMMA, across item boundaries, so a tile's last steps load the next tile's
        first ones and its epilogue runs while they land. The next item's descriptors (A, B, C of
        its group, made on the device) are made while the item's first product runs, into a ring
        of DESC_RING slots. The fp32 accumulator goes out through TMA (two halves through one
        staging buffer; the per-group C descriptor clips rows past M_g), or with TMA_STORE off
        stored from registers with masks.
        Explicit here (Triton would choose): the persistent grid and the item order, the ring (its
        depth, barriers and phases, counted across items), the refill of a buffer only after both
        warpgroups have retired the product that read it, the prefetch across items, when
        descriptors are made and how long each lives, the accumulator layout and the epilogue's
        staging."""
        dtype: gl.constexpr = c_ptr.dtype.element_ty
        A_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], dtype)
        B_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BN], dtype)
        C_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN // 2], dtype)
        ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                        instr_shape=[16, BN, 16])
        a_s = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], A_SL)
        b_s = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], B_SL)
        if TMA_STORE:
            c_s = gl.allocate_shared_memory(dtype, [BM, BN // 2], C_SL)  # half a tile: the ring keeps 192 KB
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        gl.static_assert(DESC_RING >= 3, "a descriptor slot is rewritten only when its item is two back")
        n_col = gl.cdiv(N, BN)
        nk = gl.cdiv(K, BK)
        ahead = gl.minimum(nk, STAGES - 1)  # never more than one item ahead: _prefetch's two cases
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        g, m0, n0 = _tile_of(pid, tiles_ptr, n_row_tiles, n_col, BM, BN, BAND)
        # the first item's descriptors (its own slot; later items' rotate through the ring below)
        a_d, b_d, c_d = _group_descs(table_ptr, g, c_ptr, N, K, A_SL, B_SL, C_SL, BM, BN, BK)
        for s in gl.static_range(STAGES - 1):
            if s < ahead:
                _issue_k_step(a_d, b_d, m0, n0, s, s, a_s, b_s, bars)
        a_n, b_n, c_n = a_d, b_d, c_d
        acc = gl.zeros([BM, BN], gl.float32, ACC_L)  # (never read: an item's first product has use_acc off)
        j = 0  # K steps of this program consumed before this item: the ring's slots and phases run on
        for i in range(gl.cdiv(n_items - pid, P)):
            has_next = pid + (i + 1) * P < n_items
            gn, m0n, n0n = _tile_of(gl.minimum(pid + (i + 1) * P, n_items - 1), tiles_ptr, n_row_tiles, n_col,
                                    BM, BN, BAND)
            acc = _mma_k_step(acc, j, a_s, b_s, bars, False)
            # The next item's descriptors, while step 0's product runs. Slot (i + 1) % DESC_RING was
            # last written for item i + 1 - DESC_RING (at most item i - 2): every load through it has
            # landed (consumed), and its C stores were read out before item i - 1 staged its tile.
            # A slot in flight must not be rewritten: TMA reads the descriptor from global memory.
            for d in gl.static_range(DESC_RING):
                if has_next & ((i + 1) % DESC_RING == d):
                    a_n, b_n, c_n = _group_descs(table_ptr, gn, c_ptr, N, K, A_SL, B_SL, C_SL, BM, BN, BK)
            _prefetch(ahead, j + ahead, nk, has_next, a_d, b_d, m0, n0, a_n, b_n, m0n, n0n, a_s, b_s, bars)
            for kk in range(1, nk):
                acc = _mma_k_step(acc, j + kk, a_s, b_s, bars, True)
                _prefetch(kk + ahead, j + kk + ahead, nk, has_next, a_d, b_d, m0, n0, a_n, b_n, m0n, n0n,
                          a_s, b_s, bars)
            # the last product; its slot refills at the next item's first step, after that step's barrier
            acc = warpgroup_mma_wait(0, deps=[acc])  # (one dependency: returned as is, not in a tuple)
            if TMA_STORE:
                _store_tile_tma(acc, c_d, m0, n0, c_s)
            else:
                _store_tile_masked(acc, c_ptr, table_ptr, g, m0, n0, N)
            j += nk
            a_d, b_d, c_d = a_n, b_n, c_n
            g, m0, n0 = gn, m0n, n0n
        if TMA_STORE:
            tma.store_wait(0)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

    # ------------------------------------------------------------------------------------------
    # The warp-specialized form (WARP_SPECIALIZED): one TMA producer warp and two consumer
    # warpgroups that talk only through mbarriers, so the K loop has no CTA barrier.
    # ------------------------------------------------------------------------------------------
    @gluon.jit
    def _ws_producer(table_ptr, tiles_ptr, c_ptr, N, K, n_row_tiles, n_items, a_s, b_s, ready, empty,
                     BN: gl.constexpr, BAND: gl.constexpr):
        """The producer partition (1 warp): every K step of the program's items, in order, into
        the ring. Step j waits until slot j % STAGES is empty (both consumer warpgroups have
        retired the product that read step j - STAGES; a fresh barrier's "previous phase" counts
        as complete, hence the parity flipped), then loads A and B on the slot's ready barrier."""
        STAGES: gl.constexpr = a_s.shape[0]
        BM: gl.constexpr = a_s.shape[1]
        BK: gl.constexpr = a_s.shape[2]
        dtype: gl.constexpr = c_ptr.dtype.element_ty
        A_SL: gl.constexpr = a_s.type.layout
        B_SL: gl.constexpr = b_s.type.layout
        n_col = gl.cdiv(N, BN)
        nk = gl.cdiv(K, BK)
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        g, m0, n0 = _tile_of(pid, tiles_ptr, n_row_tiles, n_col, BM, BN, BAND)
        a_d, b_d = _group_ab_descs(table_ptr, g, N, K, dtype, A_SL, B_SL, BM, BN, BK)  # item 0's own slot
        j = 0  # ring steps issued before this item
        for i in range(gl.cdiv(n_items - pid, P)):
            if i > 0:
                g, m0, n0 = _tile_of(pid + i * P, tiles_ptr, n_row_tiles, n_col, BM, BN, BAND)
            mbarrier.wait(empty.index(j % STAGES), ((j // STAGES) & 1) ^ 1)
            # Item i's descriptors, in ring slot i % STAGES (item 0 has its own). The wait above
            # says step j - STAGES has been consumed, so loads still in flight belong to steps
            # j - STAGES + 1 .. j - 1, i.e. to items i - STAGES + 1 .. i - 1 at the oldest (one
            # step per item when K <= BK): the slot's previous owner, item i - STAGES, has landed
            # every load, and TMA, which reads a descriptor from global memory, is done with it.
            for d in gl.static_range(STAGES):
                if (i > 0) & (i % STAGES == d):
                    a_d, b_d = _group_ab_descs(table_ptr, g, N, K, dtype, A_SL, B_SL, BM, BN, BK)
            _issue_k_step(a_d, b_d, m0, n0, 0, j, a_s, b_s, ready)
            for kk in range(1, nk):
                mbarrier.wait(empty.index((j + kk) % STAGES), (((j + kk) // STAGES) & 1) ^ 1)
                _issue_k_step(a_d, b_d, m0, n0, kk, j + kk, a_s, b_s, ready)
            j += nk

    @gluon.jit
    def _ws_mma_k_step(acc, j, a_s, b_s, ready, empty, HALF: gl.constexpr, use_acc, release_prev):
        """Ring step j for one consumer warpgroup: wait for its loads, start the product of its
        HALF of A's rows with all of B asynchronously, retire the product before (step j - 1's:
        at most this one is left in flight) and hand its slot back to the producer. Only thread
        0 of the warpgroup arrives (Triton's lowering), after a 128-thread barrier of this
        warpgroup that Triton 3.6 puts before the arrive (its membar pass; the PTX shows it): all
        four warps have passed their wait_group by then. One arrival per warpgroup, as CUTLASS's
        consumers release a stage. The producer refills the slot only once both warpgroups have
        arrived (count 2), so the refill waits for the other warpgroup's product too, without a
        CTA barrier (the race of triton issue 11047 cannot happen)."""
        STAGES: gl.constexpr = a_s.shape[0]
        ROWS: gl.constexpr = a_s.shape[1] // 2
        slot = j % STAGES
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        a_half = a_s.index(slot).slice(HALF * ROWS, ROWS)  # 64 rows: whole 128-byte swizzle atoms
        acc = warpgroup_mma(a_half, b_s.index(slot), acc, use_acc=use_acc, is_async=True)
        acc, _a, _b = warpgroup_mma_wait(1, deps=[acc, a_half, b_s.index(slot)])
        mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), pred=release_prev)
        return acc

    @gluon.jit
    def _ws_consumer(table_ptr, tiles_ptr, c_ptr, N, K, n_row_tiles, n_items, a_s, b_s, ready, empty, c_s,
                     HALF: gl.constexpr, BN: gl.constexpr, BAND: gl.constexpr, TMA_STORE: gl.constexpr):
        """A consumer partition (one warpgroup): rows HALF * BM / 2 .. of every item's tile, a
        [BM / 2, BN] fp32 accumulator (128 registers a thread at 64 x 256), one WGMMA in flight;
        the item's rows stored through this warpgroup's own [BM / 2, BN / 2] staging buffer by TMA
        (or, TMA_STORE off, from registers with masks). The C descriptor of item i is made while
        its first product runs, into a ring of 2 slots (item 0 has its own): slot i % 2 was item
        i - 2's, whose stores were read out before item i - 1 staged its tile."""
        STAGES: gl.constexpr = a_s.shape[0]
        BM: gl.constexpr = a_s.shape[1]
        BK: gl.constexpr = a_s.shape[2]
        ROWS: gl.constexpr = BM // 2
        ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                        instr_shape=[16, BN, 16])
        gl.static_assert(gl.num_warps() == 4, "a consumer is one warpgroup")
        C_SL: gl.constexpr = c_s.type.layout
        n_col = gl.cdiv(N, BN)
        nk = gl.cdiv(K, BK)
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        g, m0, n0 = _tile_of(pid, tiles_ptr, n_row_tiles, n_col, BM, BN, BAND)
        c_d = _group_c_desc(table_ptr, g, c_ptr, N, C_SL, ROWS, BN // 2)
        acc = gl.zeros([ROWS, BN], gl.float32, ACC_L)  # (never read: an item's first product has use_acc off)
        j = 0  # ring steps consumed before this item
        for i in range(gl.cdiv(n_items - pid, P)):
            if i > 0:
                g, m0, n0 = _tile_of(pid + i * P, tiles_ptr, n_row_tiles, n_col, BM, BN, BAND)
            # step 0: the previous item's last slot was released after its final wait
            acc = _ws_mma_k_step(acc, j, a_s, b_s, ready, empty, HALF, False, False)
            for d in gl.static_range(2):
                if (i > 0) & (i % 2 == d):
                    c_d = _group_c_desc(table_ptr, g, c_ptr, N, C_SL, ROWS, BN // 2)
            for kk in range(1, nk):
                acc = _ws_mma_k_step(acc, j + kk, a_s, b_s, ready, empty, HALF, True, True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index((j + nk - 1) % STAGES))
            if TMA_STORE:
                _store_tile_tma(acc, c_d, m0 + HALF * ROWS, n0, c_s)
            else:
                _store_tile_masked(acc, c_ptr, table_ptr, g, m0 + HALF * ROWS, n0, N)
            j += nk
        if TMA_STORE:
            tma.store_wait(0)

    @gluon.jit
    def _grouped_gemm_fwd_ws_kernel(table_ptr, tiles_ptr, c_ptr, N, K, n_row_tiles, n_items,
                                    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                                    BAND: gl.constexpr, TMA_STORE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                    PRODUCER_REGS: gl.constexpr):
        """The same product and item order as `_grouped_gemm_fwd_kernel` (C tiles [BM, BN], items
        pid, pid + P, ... in Triton's banded order; grid (P,), one program per SM), warp
        specialized: launched with 4 warps (the default partition, consumer warpgroup 0) plus a
        second consumer warpgroup and a 1-warp TMA producer, 12 warps in all (Triton pads the
        producer to a warpgroup so that registers can move: `setmaxnreg` gives the consumers
        CONSUMER_REGS each and the producer PRODUCER_REGS, out of the launch's maxnreg).
        The ring of STAGES (A, B) buffers has a ready barrier per slot (the producer's expect +
        TMA bytes) and an empty one (count 2: each consumer warpgroup arrives once it has
        retired the product that read the slot). So the producer runs up to STAGES steps ahead,
        across items, without waiting for the consumers' issue order, and the consumers never
        meet at a CTA barrier in the K loop: each keeps one WGMMA of its 64 rows in flight.
        Explicit here (Triton would choose): the partitions and their registers, the ring's two
        barriers per slot and their phases (counted across items), who may refill a slot and
        when, the descriptor rings of each partition, the accumulator split across warpgroups,
        and the epilogue's staging (a [BM / 2, BN / 2] buffer per warpgroup)."""
        dtype: gl.constexpr = c_ptr.dtype.element_ty
        A_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], dtype)
        B_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BN], dtype)
        C_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM // 2, BN // 2], dtype)
        a_s = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], A_SL)
        b_s = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], B_SL)
        # one staging buffer per consumer warpgroup (16 KB each; the masked form leaves them unused)
        c_s = gl.allocate_shared_memory(dtype, [2, BM // 2, BN // 2], C_SL)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)
        fence_async_shared()
        gl.warp_specialize([
            (_ws_consumer, (table_ptr, tiles_ptr, c_ptr, N, K, n_row_tiles, n_items, a_s, b_s, ready, empty,
                            c_s.index(0), 0, BN, BAND, TMA_STORE)),
            (_ws_consumer, (table_ptr, tiles_ptr, c_ptr, N, K, n_row_tiles, n_items, a_s, b_s, ready, empty,
                            c_s.index(1), 1, BN, BAND, TMA_STORE)),
            (_ws_producer, (table_ptr, tiles_ptr, c_ptr, N, K, n_row_tiles, n_items, a_s, b_s, ready, empty,
                            BN, BAND)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))


def _fits(a: list[torch.Tensor], b: list[torch.Tensor], K: int, N: int) -> bool:
    """Whether TMA can read every a_i and b_i: 16-byte aligned bases and rows, unit last strides."""
    e = b[0].element_size()
    return ((K * e) % 16 == 0 and (N * e) % 16 == 0
            and all(t.data_ptr() % 16 == 0 and t.is_contiguous() for t in list(a) + list(b)))


def grouped_gemm_forward_gluon(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """c stacked [sum M_i, N] (`triton_kernels.grouped_gemm_forward_triton`'s contract); operands
    TMA cannot read (unaligned K or N rows) run Triton's forward."""
    K, N = b[0].shape
    if not _fits(a, b, K, N):
        return triton_kernels.grouped_gemm_forward_triton(a, b)
    Ms = [x.shape[0] for x in a]
    c = new_empty((sum(Ms), N), a[0].dtype, a[0].device)
    tiles = [(g, t) for g in range(len(a)) for t in range(cdiv(Ms[g], BM))]
    if not tiles:  # (K = 0 and N = 0 never reach a backend: the op's entry point answers them)
        return c
    starts = [sum(Ms[:g]) for g in range(len(a))]
    table = device_table([[a[g].data_ptr(), b[g].data_ptr(), starts[g], Ms[g]] for g in range(len(a))], torch.int64,
                         c.device)
    tiles_t = device_table(tiles, torch.int32, c.device)
    n_items = len(tiles) * cdiv(N, BN)
    ensure_descriptor_allocator()  # the device-side descriptors' scratch
    grid = (min(n_items, sm_count(c.device)),)
    if WARP_SPECIALIZED:
        _grouped_gemm_fwd_ws_kernel[grid](
            table, tiles_t, c, N, K, len(tiles), n_items, BM, BN, BK, STAGES, BAND, TMA_STORE, WS_CONSUMER_REGS,
            WS_PRODUCER_REGS, num_warps=4, maxnreg=WS_MAXNREG)
    else:
        _grouped_gemm_fwd_kernel[grid](
            table, tiles_t, c, N, K, len(tiles), n_items, BM, BN, BK, STAGES, BAND, DESC_RING, TMA_STORE,
            num_warps=NUM_WARPS)
    return c


# the backward is Triton's (d a and d b are two more grouped products; the forward is timed first)
grouped_gemm_backward_gluon = triton_kernels.grouped_gemm_backward_triton


# --------------------------------------------------------------------------------------------
# CPU compile checks (tileport.compile_check)
# --------------------------------------------------------------------------------------------
def compile_cases():
    """The forward in bf16 and fp16 at the bench's K = N = 4096 with the TMA-store epilogue (its
    PTX holds the shared-to-global tensor copy), and in bf16 with the masked epilogue (TMA_STORE
    off, the A/B form); each on the single-partition kernel and on the warp-specialized one (its
    PTX also holds the `setmaxnreg` register moves; tests/test_gluon_compile.py checks its K
    loops' barriers)."""
    if _GLUON_ERROR is not None:
        return []
    from tileport.compile_check import CompileCase, TensorStandIn

    cases = []
    for ws in (False, True):
        for dtype, tma_store in ((torch.bfloat16, True), (torch.float16, True), (torch.bfloat16, False)):
            args = dict(table_ptr=TensorStandIn([8, 4], torch.int64), tiles_ptr=TensorStandIn([128, 2], torch.int32),
                        c_ptr=TensorStandIn([16384, 4096], dtype), N=4096, K=4096, n_row_tiles=128, n_items=2048,
                        BM=BM, BN=BN, BK=BK, STAGES=STAGES, BAND=BAND)
            store_ptx = "cp.async.bulk.tensor.2d.global.shared" if tma_store else "st.global"
            expect = ["wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait", "tensormap", store_ptx]
            if ws:
                args.update(TMA_STORE=tma_store, CONSUMER_REGS=WS_CONSUMER_REGS, PRODUCER_REGS=WS_PRODUCER_REGS)
                kernel, num_warps, options = _grouped_gemm_fwd_ws_kernel, 4, dict(maxnreg=WS_MAXNREG)
                expect += ["mbarrier.arrive.shared", "setmaxnreg.dec.sync.aligned.u32", "setmaxnreg.inc.sync.aligned.u32"]
            else:
                args.update(DESC_RING=DESC_RING, TMA_STORE=tma_store)
                kernel, num_warps, options = _grouped_gemm_fwd_kernel, NUM_WARPS, {}
            cases.append(CompileCase(name=f"grouped_gemm_fwd{'_ws' if ws else ''}_{str(dtype).removeprefix('torch.')}"
                                          + ("" if tma_store else "_masked_store"),
                                     kernel=kernel, args=args, num_warps=num_warps, options=options,
                                     expect_ptx=expect, expect_max_spills=0))
    return cases
