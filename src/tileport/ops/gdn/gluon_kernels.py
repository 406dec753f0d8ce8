"""Gated DeltaNet, Gluon backend for Hopper (sm_90): the forward's state recurrence and output, and
in the backward the two state recurrences, stage 9 (its chunk-local and its state part) and stage
10 in Gluon.

The backend "gluon" is the Triton backend (tileport.ops.gdn.triton_kernels) with the forward's
stages 5 and 6 replaced by Gluon kernels (FORWARD_FORM):
- "fused" (where there are enough (sequence, head) pairs, the default at S1):
  `_states_output_kernel`, the state recurrence and each chunk's output in one kernel, h on chip:
  a two-deep TMA ring over the chunks, five asynchronous WGMMAs per chunk waited for in the
  recurrence's order, BV = 128 columns of the state on two warpgroups, the gates staged a chunk
  ahead. H200: 0.385 ms at S1 against Triton's fused form's 0.514 (470f621); whole forward 0.654
  ms against Triton's 0.813 (c9aa543; FLA 0.96-1.09 in the bench of the same commit).
- "split": Triton's stages 1-5, then `_output_kernel` or `_output_persistent_kernel` (OUTPUT_FORM):
  TMA for the four tiles of a chunk, three WGMMAs with fp32 accumulators.
Stages 1-3 are Triton's. The backward is Triton's stages with its two state recurrences (the
recompute's stage 5, BACKWARD_STATES, and stage 8, BACKWARD_DSTATES) on `_tf32_recurrence_kernel`:
tf32 WGMMA on the recompute's fp32 operands, those that tf32 WGMMA must read K-major written to
shared memory transposed. H200: stage 8 0.674 ms at S1 against Triton's 1.517 (5117b1b); stage 5
0.526 against 0.633 (a8d219f); the whole backward 9.18 -> 8.21 ms. Stage 9's state part runs on
`_dqkwg_state_kernel` (BACKWARD_DQKWG, DQKWG_STATE_FORM 'loop'): 9b 1.80 -> ~1.16 ms, the whole
backward 8.14 -> 7.70 (d0ddc54); stage 10 on `_wy_bwd_tf32_kernel` (BACKWARD_WY): 2.54 -> 1.16 ms,
the backward 7.57 -> 6.18 (b39a43f); stage 9's chunk-local part on `_dqk_local_tf32_kernel`
(DQK_LOCAL): 1.03 -> ~0.61 ms, bitwise Triton's, the backward 6.13 -> 5.73 (9a1008f). Written
and off until timed: 9a together with stage 7 in one launch (DQK_LOCAL_AT) and k's l2norm backward
inside stage 10 (WY_L2NORM_K). The CPU compile check asserts
wgmma.mma_async and cp.async.bulk.tensor in every kernel's PTX (tests/test_gluon_compile.py).

bf16 only (the backward's recurrences take fp32 operands, which the backward of bf16 inputs
keeps): the Triton kernels give fp16 inputs bf16 matmul operands (gate products underflow
fp16), which would need a conversion pass before TMA, and fp32 inputs exact fp32 products, which
WGMMA (tf32) does not give.
"""

from __future__ import annotations

import functools
import itertools

import torch

from tileport.memory import new_empty

try:  # the module must import on a CPU machine and without Gluon
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _GLUON_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the installed triton
    _GLUON_ERROR = f"triton.experimental.gluon is unavailable ({type(exc).__name__}: {exc})"

BT = 64  # chunk: the M of every WGMMA here, one warpgroup (4 warps) of 16-row slices
HEAD_DIMS = (64, 128)

__all__ = ["gluon_refusal", "gdn_forward_gluon", "gdn_backward_gluon", "compile_cases", "OUTPUT_FORM",
           "FORWARD_FORM"]


def gluon_refusal(K: int, V: int, dtype: torch.dtype) -> str | None:
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    if dtype != torch.bfloat16:
        return f"{dtype}: the Gluon GDN kernels take bfloat16 only (fp16 needs bf16 operands, fp32 exact products)"
    if K not in HEAD_DIMS or V not in HEAD_DIMS:
        return f"K={K}, V={V}: the Gluon GDN kernels take head dims {HEAD_DIMS}"
    if K != V:
        # they compile for sm_90a at K != V, but every H200 run of them had K == V; Triton's
        # kernels, run there at K != V, take these calls until a GPU gate covers the pair
        return f"K={K}, V={V}: the Gluon GDN kernels have run on the H200 with K == V only"
    return None


if _GLUON_ERROR is None:

    @gluon.jit
    def _chunk_bounds(chunks_ptr, c):
        """The first token and the end of chunk c of the plan (int32: TMA coordinates are)."""
        return gl.load(chunks_ptr + 2 * c).to(gl.int32), gl.load(chunks_ptr + 2 * c + 1).to(gl.int32)

    @gluon.jit
    def _issue_chunk_tiles(q_desc, k_desc, vn_desc, h_desc, chunks_ptr, item, H, q_b, k_b, vn_b, h_b, bar,
                           K: gl.constexpr, V: gl.constexpr):
        """TMA the q, k, Vn tiles and the state h_c of work item `item` = c * H + hh (chunk c,
        head hh) into one set of buffers, all four on `bar`, armed with their bytes."""
        c = item // H
        hh = item % H
        # TMA coordinates are int32 (a descriptor's dims are too); the plan may hold int64 offsets
        bos = gl.load(chunks_ptr + 2 * c).to(gl.int32)
        NBYTES: gl.constexpr = (q_desc.block_type.nbytes + k_desc.block_type.nbytes + vn_desc.block_type.nbytes
                                + h_desc.block_type.nbytes)
        mbarrier.expect(bar, NBYTES)
        tma.async_copy_global_to_shared(q_desc, [bos, hh * K], bar, q_b)
        tma.async_copy_global_to_shared(k_desc, [bos, hh * K], bar, k_b)
        tma.async_copy_global_to_shared(vn_desc, [bos, hh * V], bar, vn_b)
        tma.async_copy_global_to_shared(h_desc, [(c * H + hh) * K, 0], bar, h_b)

    @gluon.jit
    def _chunk_gates(G_ptr, t0, eos, H, hh, S_L: gl.constexpr):
        """The gates G of the chunk starting at token t0 as P's rows and columns want them (the
        two slices of S_L, 0 past the sequence), and which rows are in it (< eos). Loaded apart
        from their use so a caller can issue them early, under other work."""
        BT: gl.constexpr = S_L.instr_shape[0] * 4  # the chunk: M of the [64, 64] accumulator
        r = gl.arange(0, BT, layout=gl.SliceLayout(1, S_L))
        cidx = gl.arange(0, BT, layout=gl.SliceLayout(0, S_L))
        r_ok = t0 + r < eos
        c_ok = t0 + cidx < eos
        Gr = gl.load(G_ptr + (t0 + r).to(gl.int64) * H + hh, mask=r_ok, other=0.0)
        Gc = gl.load(G_ptr + (t0 + cidx).to(gl.int64) * H + hh, mask=c_ok, other=0.0)
        return Gr, Gc, r_ok, c_ok

    @gluon.jit
    def _gated_causal(s, Gr, Gc, r_ok, c_ok):
        """P = lower(S * Gam) for one chunk: S [64, 64] (Q K^T) times exp(G_t - G_s) on t >= s
        and both rows in the sequence, 0 elsewhere; Gr, Gc, r_ok, c_ok from `_chunk_gates`."""
        BT: gl.constexpr = s.shape[0]
        r = gl.arange(0, BT, layout=Gr.type.layout)
        cidx = gl.arange(0, BT, layout=Gc.type.layout)
        m = (r[:, None] >= cidx[None, :]) & r_ok[:, None] & c_ok[None, :]
        gam = gl.exp(gl.where(m, (Gr[:, None] - Gc[None, :]).to(gl.float32), float("-inf")))  # 0 off the mask
        return gl.where(m, s * gam, 0.0)

    @gluon.jit
    def _chunk_output(q_b, k_b, vn_b, h_b, G_ptr, o_ptr, chunks_ptr, item, H, scale, eps,
                      K: gl.constexpr, V: gl.constexpr, L2NORM_Q: gl.constexpr):
        """O of work item `item` from its tiles, already in shared memory: S = Q K^T and Q h by
        WGMMA from shared memory, P = S * Gam masked in registers, O = Q h exp(G) + P Vn with P
        handed to the last WGMMA from registers; stored with a row mask (a varlen chunk's tail rows
        belong to the next sequence). L2NORM_Q: q is normalised in shared memory first."""
        BT: gl.constexpr = q_b.shape[0]  # the chunk (64)
        c = item // H
        hh = item % H
        bos, eos = _chunk_bounds(chunks_ptr, c)
        if L2NORM_Q:
            ROWS_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            qf = q_b.load(ROWS_L).to(gl.float32)
            qn = qf * gl.rsqrt(gl.sum(qf * qf, axis=1) + eps)[:, None]
            gl.thread_barrier()  # every warp has read q before any overwrites it
            q_b.store(qn.to(q_b.dtype))
            fence_async_shared()  # generic-proxy writes, then the async proxy (WGMMA, TMA) reads/writes
            gl.thread_barrier()

        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, V, 16])
        s = warpgroup_mma(q_b, k_b.permute((1, 0)), gl.zeros([BT, BT], gl.float32, S_L))
        o = warpgroup_mma(q_b, h_b, gl.zeros([BT, V], gl.float32, O_L))

        Gr, Gc, r_ok, c_ok = _chunk_gates(G_ptr, bos, eos, H, hh, S_L)
        P = _gated_causal(s, Gr, Gc, r_ok, c_ok)

        ro = gl.arange(0, BT, layout=gl.SliceLayout(1, O_L))
        co = gl.arange(0, V, layout=gl.SliceLayout(0, O_L))
        ro_ok = bos + ro < eos
        Go = gl.load(G_ptr + (bos + ro).to(gl.int64) * H + hh, mask=ro_ok, other=0.0)
        o = o * gl.exp(Go.to(gl.float32))[:, None]
        P_op = gl.convert_layout(P.to(vn_b.dtype), gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2))
        o = warpgroup_mma(P_op, vn_b, o)

        offs = ((bos + ro).to(gl.int64) * H + hh)[:, None] * V + co[None, :]
        # lint: allow TP001 -- a varlen chunk's tail rows belong to the next sequence: a 64-row TMA store would overwrite them; the masked store writes only this chunk's rows
        gl.store(o_ptr + offs, (o * scale).to(o_ptr.dtype.element_ty), mask=ro_ok[:, None])

    @gluon.jit
    def _output_kernel(q_desc, k_desc, vn_desc, h_desc, G_ptr, o_ptr, chunks_ptr, H, scale, eps,
                       K: gl.constexpr, V: gl.constexpr, L2NORM_Q: gl.constexpr):
        """6: O = scale (diag(exp(G)) Q h_c + lower(Q K^T * Gam) Vn) for one chunk and head, in o's
        dtype; grid (NC, H), 4 warps. q, k [Ntok, H*K], Vn [Ntok, H*V] and h [NC*H*K, V] come
        in through TMA (one mbarrier for all four tiles; rows past the tensor are zero-filled, rows
        of the next sequence in a varlen tail are loaded and masked out of P and of the store).
        Explicit here (Triton would choose): the descriptors and the barrier, the accumulator
        layouts of the three WGMMAs (S = Q K^T [64, 64], Q h [64, V], += P Vn), P handed to the
        last WGMMA from registers, h and K^T read by the WGMMAs straight from shared memory (K^T
        as a transposed view)."""
        BT: gl.constexpr = q_desc.block_type.shape[0]
        q_s = gl.allocate_shared_memory(q_desc.dtype, [BT, K], q_desc.layout)
        k_s = gl.allocate_shared_memory(k_desc.dtype, [BT, K], k_desc.layout)
        vn_s = gl.allocate_shared_memory(vn_desc.dtype, [BT, V], vn_desc.layout)
        h_s = gl.allocate_shared_memory(h_desc.dtype, [K, V], h_desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        fence_async_shared()
        item = gl.program_id(0) * H + gl.program_id(1)
        _issue_chunk_tiles(q_desc, k_desc, vn_desc, h_desc, chunks_ptr, item, H, q_s, k_s, vn_s, h_s, bar, K, V)
        mbarrier.wait(bar, 0)
        _chunk_output(q_s, k_s, vn_s, h_s, G_ptr, o_ptr, chunks_ptr, item, H, scale, eps, K, V, L2NORM_Q)
        mbarrier.invalidate(bar)

    @gluon.jit
    def _output_persistent_kernel(q_desc, k_desc, vn_desc, h_desc, G_ptr, o_ptr, chunks_ptr, H, n_items, scale, eps,
                                  K: gl.constexpr, V: gl.constexpr, L2NORM_Q: gl.constexpr):
        """6, persistent: program p computes work items p, p + P, p + 2P, ... (item = c * H + hh;
        P programs, as many as fit on the card at once), with two sets of tile buffers: the TMA
        loads of its next item are in flight while the WGMMAs of this one run. Grid (P,), 4
        warps; 160 KB of shared memory at K = V = 128 (one CTA per SM), 64 KB at 64.
        Why: the one-item kernel (`_output_kernel`) waits for its 80 KB of tiles with nothing to
        overlap, and at S1 took ~0.39 ms for 0.19 ms of bytes (H200, 909a64e). Explicit here
        (Triton would choose): the buffer ring of depth two and its barriers (buffer b's phase
        flips at every reuse: (i // 2) & 1), the thread barrier that keeps the refill of a buffer
        behind every warp's last read of it."""
        BT: gl.constexpr = q_desc.block_type.shape[0]
        q_s = gl.allocate_shared_memory(q_desc.dtype, [2, BT, K], q_desc.layout)
        k_s = gl.allocate_shared_memory(k_desc.dtype, [2, BT, K], k_desc.layout)
        vn_s = gl.allocate_shared_memory(vn_desc.dtype, [2, BT, V], vn_desc.layout)
        h_s = gl.allocate_shared_memory(h_desc.dtype, [2, K, V], h_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):
            mbarrier.init(bars.index(b), count=1)
        fence_async_shared()
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        my_n = (n_items - pid + P - 1) // P
        if my_n > 0:
            _issue_chunk_tiles(q_desc, k_desc, vn_desc, h_desc, chunks_ptr, pid, H, q_s.index(0), k_s.index(0),
                               vn_s.index(0), h_s.index(0), bars.index(0), K, V)
        for i in range(my_n):
            buf = i % 2
            if i + 1 < my_n:
                nxt = (i + 1) % 2
                gl.thread_barrier()  # every warp is done with buffer set nxt (item i - 1) before its refill
                _issue_chunk_tiles(q_desc, k_desc, vn_desc, h_desc, chunks_ptr, pid + (i + 1) * P, H, q_s.index(nxt),
                                   k_s.index(nxt), vn_s.index(nxt), h_s.index(nxt), bars.index(nxt), K, V)
            mbarrier.wait(bars.index(buf), (i // 2) & 1)
            _chunk_output(q_s.index(buf), k_s.index(buf), vn_s.index(buf), h_s.index(buf), G_ptr, o_ptr, chunks_ptr,
                          pid + i * P, H, scale, eps, K, V, L2NORM_Q)
        for b in gl.static_range(2):
            mbarrier.invalidate(bars.index(b))


    @gluon.jit
    def _sequence_program(cu_ptr, H, BT: gl.constexpr):
        """What a program of the sequential kernels (grid (N * H, V / BV)) works on: its sequence n,
        head hh and V block jv, the sequence's tokens [bos, eos) and its number of chunks nc."""
        nh = gl.program_id(0)
        n = nh // H
        bos = gl.load(cu_ptr + n).to(gl.int32)
        eos = gl.load(cu_ptr + n + 1).to(gl.int32)
        return n, nh % H, gl.program_id(1), bos, eos, (eos - bos + BT - 1) // BT

    @gluon.jit
    def _issue_recurrence_tiles(q_desc, k_desc, w_desc, u_desc, t0, hh, ucol, q_b, k_b, w_b, u_b, bar,
                                K: gl.constexpr, WITH_W: gl.constexpr = True):
        """TMA the q, k, W tiles ([64, K]) and the U tile ([64, BV] from column ucol) of the chunk
        that starts at token t0, head hh, into one buffer set, all on `bar`, armed with their
        bytes. Without WITH_W, W's tile is not loaded (KDA's Vn from T: w_b is formed in the kernel)."""
        NBYTES: gl.constexpr = (q_desc.block_type.nbytes + k_desc.block_type.nbytes
                                + (w_desc.block_type.nbytes if WITH_W else 0) + u_desc.block_type.nbytes)
        mbarrier.expect(bar, NBYTES)
        tma.async_copy_global_to_shared(q_desc, [t0, hh * K], bar, q_b)
        tma.async_copy_global_to_shared(k_desc, [t0, hh * K], bar, k_b)
        if WITH_W:
            tma.async_copy_global_to_shared(w_desc, [t0, hh * K], bar, w_b)
        tma.async_copy_global_to_shared(u_desc, [t0, ucol], bar, u_b)

    @gluon.jit
    def _recurrence_buffers(q_desc, k_desc, w_desc, u_desc, o_desc, K: gl.constexpr, BV: gl.constexpr,
                            RING: gl.constexpr, O_STAGED: gl.constexpr, W_SLOTS: gl.constexpr = 0):
        """The shared memory of the fused states + output kernels (GDN's `_states_output_kernel`,
        KDA's `_kda_states_output_kernel`): a ring of RING TMA sets of q, k, W [64, K] and U [64,
        BV] (W in W_SLOTS slots, 0 for RING: 1 where the kernel forms W's operand itself, KDA's Vn
        from T); h's
        bf16 copy [K, BV] and Vn [64, BV] (U's 128-byte swizzle), the scaled keys [64, K]; o's
        staging [64, BV] for its TMA store where O_STAGED (else U's ring stands in, unused); the
        ring's mbarriers, initialised and fenced."""
        BT: gl.constexpr = q_desc.block_type.shape[0]
        q_s = gl.allocate_shared_memory(q_desc.dtype, [RING, BT, K], q_desc.layout)
        k_s = gl.allocate_shared_memory(k_desc.dtype, [RING, BT, K], k_desc.layout)
        w_s = gl.allocate_shared_memory(w_desc.dtype, [W_SLOTS if W_SLOTS else RING, BT, K], w_desc.layout)
        u_s = gl.allocate_shared_memory(u_desc.dtype, [RING, BT, BV], u_desc.layout)
        h_s = gl.allocate_shared_memory(u_desc.dtype, [K, BV], u_desc.layout)
        vn_s = gl.allocate_shared_memory(u_desc.dtype, [BT, BV], u_desc.layout)
        kd_s = gl.allocate_shared_memory(k_desc.dtype, [BT, K], k_desc.layout)
        if O_STAGED:
            o_s = gl.allocate_shared_memory(o_desc.dtype, [BT, BV], o_desc.layout)
        else:
            o_s = u_s
        bars = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(RING):
            mbarrier.init(bars.index(b), count=1)
        fence_async_shared()
        return q_s, k_s, w_s, u_s, h_s, vn_s, kd_s, o_s, bars

    @gluon.jit
    def _states_output_kernel(q_desc, k_desc, w_desc, u_desc, o_desc, G_ptr, h0_ptr, ht_ptr, o_ptr, cu_ptr, H, scale, eps,
                              K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, HAS_H0: gl.constexpr,
                              STORE_FINAL: gl.constexpr, L2NORM_Q: gl.constexpr, GATES: gl.constexpr,
                              RING: gl.constexpr, O_STORE: gl.constexpr):
        """5 and 6 fused: the state recurrence and each chunk's output, h never leaving the chip.
        One program per (sequence, head, V block of BV columns), sequential over the sequence's
        chunks; grid (N * H, V / BV), 4 or 8 warps (one or two warpgroups; with two, each owns half
        of the BV columns of every [64, BV] and [K, BV] accumulator). Per chunk, with h [K, BV]
        fp32 in registers (WGMMA accumulator layout) and a bf16 copy in shared memory:
            Vn = U - W h;  O = scale (diag(exp(G)) Q h + lower(Q K^T * Gam) Vn);
            h <- exp(G_L) h + (diag(exp(G_L - G)) K)^T Vn
        as five WGMMAs (W h, Q h, Q K^T from shared memory; P Vn with P from registers; the
        update with diag(exp(G_L - G)) K written to shared memory and read as a transposed view).
        The operands are rounded as the Triton fused form rounds them (bf16 h, Vn, K scaled), so the
        two agree to accumulation order.

        The recurrence's critical path is W h -> Vn -> the update; the output's three products hang
        off it. So the WGMMAs are asynchronous and waited for in the order the chain needs them:
        W h, Q h and Q K^T are issued together, the scaled keys are formed while they run, W h is
        waited for alone (`warpgroup_mma_wait(2)`: WGMMA groups retire in order), the update is
        issued as soon as Vn is in shared memory, and the gated P and its product with Vn run
        under it. GATES says when the chunk's gates G come in: "late" (from global memory at the
        top of the chunk, P's row and column gates after the WGMMAs), "early" (all of them at the
        top: a few spilled registers; 0.690 -> 0.677 ms for the whole forward at S1, H200, two
        runs), or "staged" (loaded from global memory one chunk ahead, into one register per
        thread, and kept in shared memory for the chunk that reads them: their latency hides under
        a whole chunk, and every layout reads them from shared memory when it needs them).

        RING: the depth of the TMA ring over the chunks. 2: the next chunk's q, k, W, U tiles load
        while this chunk computes (buffer b's phase flips at each reuse). 1: one buffer set, refilled
        once the chunk is done, so the load is exposed in this program's chain; but at BV = 64 on
        one warpgroup the kernel then fits in ~97 KB of shared memory and two programs share an SM,
        each one's chain running in the issue slots the other leaves (ncu at c9aa543: one 8-warp
        CTA per SM issues on 27% of cycles).

        O_STORE: how o leaves. "masked": a masked store from the accumulator layout (4-byte stores,
        int64 addresses; ncu at c9aa543: LSU-throttle stalls 0.46 per issued instruction). "tma":
        a chunk whose rows all belong to its sequence goes through shared memory (o_s, one buffer:
        the TMA store of chunk i - 1 is waited for before the barrier that orders chunk i's Vn, a
        chunk ahead of o_s's reuse) and a TMA store; a sequence's last, partial chunk keeps the
        masked store (its tail rows are the next sequence's).

        Explicit here (Triton would choose, and in the fused Triton kernel chose a latency-bound
        schedule): the TMA ring over the chunks, the accumulator layouts,
        the order in which asynchronous WGMMAs are waited for, and the thread barriers that order
        the generic-proxy stores of h, Vn and the scaled keys before the WGMMAs (async proxy) read
        them, and every warpgroup's reads of a buffer before any refill of it (with two warpgroups
        that is also triton issue 11047's guard). Varlen: a tail chunk's TMA tiles hold rows of the
        next sequence; they are masked out of P, of the scaled keys (so out of the state) and of
        the store. Why: h and Vn are 0.8 GB stored and read back at S1 in the split form, and the
        fused Triton form runs at ~3x its memory floor (docs/perf/gdn.md, "Path to issue 5's 0.46
        ms forward")."""
        BT: gl.constexpr = q_desc.block_type.shape[0]
        NW: gl.constexpr = gl.num_warps()
        WG: gl.constexpr = NW // 4  # warpgroups, side by side along the accumulators' columns
        n, hh, jv, bos, eos, nc = _sequence_program(cu_ptr, H, BT)

        # lint: allow TP004 -- the ring's barriers are initialised in the helper and invalidated after the chunk loop below
        q_s, k_s, w_s, u_s, h_s, vn_s, kd_s, o_s, bars = _recurrence_buffers(q_desc, k_desc, w_desc, u_desc, o_desc, K, BV,
                                                                             RING, O_STORE == "tma")

        V_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, BV // WG, 16])
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, BT // WG, 16])
        ROWS_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=V_L, k_width=2)

        kr = gl.arange(0, K, layout=gl.SliceLayout(1, V_L))
        vcol = gl.arange(0, BV, layout=gl.SliceLayout(0, V_L))
        sbase = (n.to(gl.int64) * H + hh) * (K * V) + kr[:, None] * V + (jv * BV + vcol)[None, :]
        if HAS_H0:
            # lint: allow TP001 -- once per program, outside the chunk loop: 32 KB of fp32 state straight into the WGMMA accumulator layout it is used in
            h = gl.load(h0_ptr + sbase).to(gl.float32)
        else:
            h = gl.zeros([K, BV], gl.float32, V_L)
        h_s.store(h.to(h_s.dtype))
        if GATES == "staged":  # chunk 0's gates into shared memory; the first barrier in the loop orders them
            G1_L: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
            g_s = gl.allocate_shared_memory(G_ptr.dtype.element_ty, [BT], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
            r1 = gl.arange(0, BT, layout=G1_L)
            g_s.store(gl.load(G_ptr + (bos + r1).to(gl.int64) * H + hh, mask=bos + r1 < eos, other=0.0))
            last0 = gl.minimum(bos + BT, eos) - 1
            GL_cur = gl.load(G_ptr + last0.to(gl.int64) * H + hh, mask=last0 >= bos, other=0.0)

        if nc > 0:
            _issue_recurrence_tiles(q_desc, k_desc, w_desc, u_desc, bos, hh, hh * V + jv * BV, q_s.index(0),
                                    k_s.index(0), w_s.index(0), u_s.index(0), bars.index(0), K)
        rr = gl.arange(0, BT, layout=gl.SliceLayout(1, ROWS_L))
        ro = gl.arange(0, BT, layout=gl.SliceLayout(1, V_L))
        for i in range(nc):
            buf = i % RING
            t0 = bos + i * BT
            if RING == 2 and i + 1 < nc:
                # every warpgroup's WGMMAs of chunk i - 1 have retired (each waited for all of its
                # own) and every warp has passed them before buffer set 1 - buf is refilled (the
                # barrier that ends chunk i - 1 orders this too; leaving this one out measured no
                # faster on the H200, 4d9f371, and it keeps the refill safe on its own)
                gl.thread_barrier()
                _issue_recurrence_tiles(q_desc, k_desc, w_desc, u_desc, t0 + BT, hh, hh * V + jv * BV,
                                        q_s.index(1 - buf), k_s.index(1 - buf), w_s.index(1 - buf),
                                        u_s.index(1 - buf), bars.index(1 - buf), K)
            r_ok = t0 + rr < eos
            ro_ok = t0 + ro < eos
            if GATES == "staged":
                # the next chunk's gates: loaded now, into shared memory when this chunk is done
                t1 = t0 + BT
                g_next = gl.load(G_ptr + (t1 + r1).to(gl.int64) * H + hh, mask=t1 + r1 < eos, other=0.0)
                last1 = gl.minimum(t1 + BT, eos) - 1
                GL_next = gl.load(G_ptr + last1.to(gl.int64) * H + hh, mask=last1 >= t1, other=0.0)
                GL = GL_cur
            else:
                # the chunk's gates, before its tiles are waited for: their latency hides under the wait
                last = gl.minimum(t0 + BT, eos) - 1
                GL = gl.load(G_ptr + last.to(gl.int64) * H + hh)
                Gk = gl.load(G_ptr + (t0 + rr).to(gl.int64) * H + hh, mask=r_ok, other=0.0)
                Go = gl.load(G_ptr + (t0 + ro).to(gl.int64) * H + hh, mask=ro_ok, other=0.0)
                if GATES == "early":  # P's gates too (fp64, in S_L's slices): 12-64 B of spills at K = 128 (sm_90a)
                    Gr, Gc, sr_ok, sc_ok = _chunk_gates(G_ptr, t0, eos, H, hh, S_L)
            mbarrier.wait(bars.index(buf), (i // RING) & 1)
            q_b = q_s.index(buf)
            k_b = k_s.index(buf)
            if L2NORM_Q:
                qf = q_b.load(ROWS_L).to(gl.float32)
                qn = qf * gl.rsqrt(gl.sum(qf * qf, axis=1) + eps)[:, None]
                gl.thread_barrier()  # every warp has read q before any overwrites it
                q_b.store(qn.to(q_b.dtype))
            fence_async_shared()  # h (last iteration) and q written by the generic proxy, read by WGMMA
            gl.thread_barrier()

            wh = warpgroup_mma(w_s.index(buf), h_s, gl.zeros([BT, BV], gl.float32, V_L), is_async=True)
            if GATES == "staged":
                Gk = g_s.load(gl.SliceLayout(1, ROWS_L))
                Go = g_s.load(gl.SliceLayout(1, V_L))
            qh = warpgroup_mma(q_b, h_s, gl.zeros([BT, BV], gl.float32, V_L), is_async=True)
            sqk = warpgroup_mma(q_b, k_b.permute((1, 0)), gl.zeros([BT, BT], gl.float32, S_L), is_async=True)

            # the scaled keys diag(exp(G_L - G)) K (rows past the sequence: 0), under the WGMMAs
            kf = k_b.load(ROWS_L).to(gl.float32)
            kd = kf * gl.exp(gl.where(r_ok, (GL - Gk).to(gl.float32), float("-inf")))[:, None]
            kd_s.store(kd.to(kd_s.dtype))
            u_r = u_s.index(buf).load(V_L).to(gl.float32)

            wh = warpgroup_mma_wait(2, deps=[wh])  # W h alone: the chain's first link
            # lint: allow TP005 -- vn_s's readers (chunk i - 1's update and P Vn) were waited for (wait 0) before the thread barrier that ends that chunk; the wait just above is W h's, which reads w_s and h_s only
            vn_s.store((u_r - wh).to(vn_s.dtype))
            if O_STORE == "tma":
                tma.store_wait(0)  # chunk i - 1's o has left o_s; the barrier below tells every warp
            fence_async_shared()
            gl.thread_barrier()  # Vn and the scaled keys of every warp, before the update reads them
            h = warpgroup_mma(kd_s.permute((1, 0)), vn_s, h * gl.exp(GL.to(gl.float32)), is_async=True)

            qh, sqk = warpgroup_mma_wait(1, deps=[qh, sqk])  # the output's products; the update runs on
            if RING == 1 and i + 1 < nc:
                # the one buffer set is free once every warp is past this wait: W h, Q h and Q K^T
                # were its last readers (the update and P Vn read kd_s and vn_s); the next chunk's
                # tiles load under this chunk's P, P Vn, update and stores
                gl.thread_barrier()
                _issue_recurrence_tiles(q_desc, k_desc, w_desc, u_desc, t0 + BT, hh, hh * V + jv * BV, q_s.index(buf),
                                        k_s.index(buf), w_s.index(buf), u_s.index(buf), bars.index(buf), K)
            if GATES == "late":
                Gr, Gc, sr_ok, sc_ok = _chunk_gates(G_ptr, t0, eos, H, hh, S_L)
            if GATES == "staged":
                Gr = g_s.load(gl.SliceLayout(1, S_L))
                Gc = g_s.load(gl.SliceLayout(0, S_L))
                sr_ok = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, S_L)) < eos
                sc_ok = t0 + gl.arange(0, BT, layout=gl.SliceLayout(0, S_L)) < eos
            P = _gated_causal(sqk, Gr, Gc, sr_ok, sc_ok)
            o = warpgroup_mma(gl.convert_layout(P.to(vn_s.dtype), P_L), vn_s, qh * gl.exp(Go.to(gl.float32))[:, None],
                              is_async=True)
            h, o = warpgroup_mma_wait(0, deps=[h, o])
            full = t0 + BT <= eos
            if O_STORE == "tma" and full:
                o_s.store((o * scale).to(o_s.dtype))
                fence_async_shared()
            else:
                offs = ((t0 + ro).to(gl.int64) * H + hh)[:, None] * V + (jv * BV + vcol)[None, :]
                # lint: allow TP001 -- a varlen chunk's tail rows belong to the next sequence: a 64-row TMA store would overwrite them; the masked store writes only this chunk's rows
                gl.store(o_ptr + offs, (o * scale).to(o_ptr.dtype.element_ty), mask=ro_ok[:, None])
            gl.thread_barrier()  # every warpgroup's WGMMAs have read h_s, vn_s and kd_s before they are rewritten
            if O_STORE == "tma" and full:  # every warp's part of o is in o_s (the barrier above)
                tma.async_copy_shared_to_global(o_desc, [t0, hh * V + jv * BV], o_s)
            h_s.store(h.to(h_s.dtype))
            if GATES == "staged":  # every warp has read this chunk's gates (before the barrier above)
                g_s.store(g_next)
                GL_cur = GL_next
        if O_STORE == "tma":
            tma.store_wait(0)  # o_s is read by the last TMA store until it completes
        if STORE_FINAL:
            # lint: allow TP001 -- once per program, after the chunk loop: the state from its accumulator layout, no staging through shared memory
            gl.store(ht_ptr + sbase, h)
        for b in gl.static_range(RING):
            mbarrier.invalidate(bars.index(b))


    @gluon.jit
    def _channel_decay(G_ptr, rows, r_ok, kc, GL, K: gl.constexpr):
        """exp(G_L - G) on a chunk's [64, K] rows of per-channel gates G [Ntok, H, K], 0 past the
        sequence (the rows' layout is kc's parent)."""
        # lint: allow TP001 -- the chunk's per-channel gates, used in registers on K's entries (TMA would need another buffer beside the recurrence's 224 KB)
        G = gl.load(G_ptr + rows[:, None] * K + kc[None, :], mask=r_ok[:, None], other=0.0)
        return gl.where(r_ok[:, None], gl.exp((GL[None, :] - G).to(gl.float32)), 0.0)

    @gluon.jit
    def _tf32_recurrence_kernel(a_desc, x1_ptr, x2_ptr, y2_ptr, add_ptr, G_ptr, s0_ptr, s_ptr, out_ptr, sfin_ptr,
                                cu_ptr, choff_ptr, H, scale, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                                HAS_S0: gl.constexpr, STORE_FINAL: gl.constexpr, BACKWARD: gl.constexpr,
                                PER_CHANNEL: gl.constexpr, a_ptr=None, A_LOADS: gl.constexpr = False):
        """The backward's two state recurrences on fp32 operands with tf32 WGMMA: one program per
        (sequence, head, V block of BV columns), sequential over the sequence's chunks; grid
        (N * H, V / BV), 4 or 8 warps (one or two warpgroups side by side along BV). The state S
        [K, BV] fp32 lives in registers (WGMMA accumulator layout) and is stored as each chunk
        starts (for stage 9); per chunk, with A the TMA'd [64, K] tile and X the chunk's row tile:
            BACKWARD False, 5 (the recompute): S = h, A = W, X1 = K, add = U;
                Vn = U - W h                                   (out, fp32)
                h <- exp(G_L) h + K^T (diag(exp(G_L - G)) Vn)
            BACKWARD True, 8: S = dh (the gradient of the state leaving the chunk; chunks in
                reverse), A = K, X1 = W, X2 = Q, Y2 = dO, add = dVl;
                dVn = dVl + diag(exp(G_L - G)) (K dh)          (out, fp32)
                dh <- exp(G_L) dh + W^T (-dVn) + Q^T (scale diag(exp(G)) dO)
        s0 is the initial state (h0, or dht) and sfin the final one (ht, or d initial_state).
        The same products as Triton's `_states_kernel` / `_dstates_kernel` at BACKWARD_PRODUCTS
        "tf32", the gates moved from K and Q onto the other operand's rows (the tf32-rounded
        operands are K and Q themselves).

        Explicit here (Triton would choose): tf32 WGMMA reads both operands K-major only, and the
        update contracts over the chunk's tokens, along which X and Y are strided in memory; so
        X^T and Y^T are written to shared memory transposed (tokens contiguous) from registers,
        and S^T (K contiguous) for the product with A, whose tile comes in by TMA into one buffer,
        refilled with the next chunk's tile as soon as that product has read it, under the update
        (a second buffer does not fit beside the transposed operands of 8 at BV 128: 224 KB). The
        product with A is issued asynchronously and the chunk's loads and transposed stores run
        under it. Rows past the sequence (a varlen tail, whose TMA rows are the next sequence's)
        are 0 in X and Y and, through the gate factor or the masked addend, in the output.

        PER_CHANNEL (KDA: G [Ntok, H, K], the gates per key channel), as Triton's kernels with
        PER_CHANNEL: the gate cannot move onto the other operand's rows, so it stays on K's and Q's
        entries. 5: X1 = K * exp(G_L - G) (gated in registers on its way to shared memory), Y1 = Vn;
        8: A = K * exp(G_L - G), gated in place in shared memory once its TMA tile has landed (each
        thread loads and stores the same entries, so only the fence and barrier before the WGMMA
        are needed), X2 = Q * exp(G), Y2 = scale dO, dVn = dVl + A dh; both: the decay exp(G_L) per
        row of S. One [64, K] tile of G per chunk, loaded before the chunk's products.
        A_LOADS (8 with PER_CHANNEL only; a_desc None): K is 16-bit (KDA's BACKWARD_NORMALISED_QK
        "input"), read through a_ptr by pointer loads, widened and gated in registers on its way
        into A's fp32 slot (a 16-bit TMA slot beside it does not fit the 224 KB of BV 128); X2 = Q
        16-bit is widened as loaded. No TMA then: the tile's loads are not ahead of the chunk."""
        BT: gl.constexpr = 64 if A_LOADS else a_desc.block_type.shape[0]
        gl.static_assert(not A_LOADS or (BACKWARD and PER_CHANNEL), "16-bit K by loads: stage 8, per-channel gates")
        NW: gl.constexpr = gl.num_warps()
        WG: gl.constexpr = NW // 4
        n, hh, jv, bos, eos, nc = _sequence_program(cu_ptr, H, BT)
        c0 = gl.load(choff_ptr + n).to(gl.int32)

        # tf32 WGMMA: instruction K of 8; [64, BV] and [K, BV] accumulators share the layout
        D_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, BV // WG, 8])
        ROWS_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])  # [64, K] and [64, BV] rows
        ST_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BV, K], gl.float32)
        XT_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, BT], gl.float32)
        YT_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BV, BT], gl.float32)
        A_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, K], gl.float32) if A_LOADS else a_desc.layout
        a_s = gl.allocate_shared_memory(gl.float32, [BT, K], A_SL)
        sT_s = gl.allocate_shared_memory(gl.float32, [BV, K], ST_SL)
        x1T_s = gl.allocate_shared_memory(gl.float32, [K, BT], XT_SL)
        y1T_s = gl.allocate_shared_memory(gl.float32, [BV, BT], YT_SL)
        if BACKWARD:
            x2T_s = gl.allocate_shared_memory(gl.float32, [K, BT], XT_SL)
            y2T_s = gl.allocate_shared_memory(gl.float32, [BV, BT], YT_SL)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        fence_async_shared()

        kr = gl.arange(0, K, layout=gl.SliceLayout(1, D_L))
        vcol = gl.arange(0, BV, layout=gl.SliceLayout(0, D_L))
        sblk = kr[:, None] * V + (jv * BV + vcol)[None, :]
        state = (n.to(gl.int64) * H + hh) * (K * V)
        if HAS_S0:
            # lint: allow TP001 -- once per program, outside the chunk loop: the state straight into the accumulator layout it is used in
            S = gl.load(s0_ptr + state + sblk).to(gl.float32)
        else:
            S = gl.zeros([K, BV], gl.float32, D_L)
        if nc > 0 and not A_LOADS:
            first = nc - 1 if BACKWARD else 0
            mbarrier.expect(bar, a_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [bos + first * BT, hh * K], bar, a_s)
        rr = gl.arange(0, BT, layout=gl.SliceLayout(1, ROWS_L))
        rh = gl.arange(0, BT // 2, layout=gl.SliceLayout(1, ROWS_L))
        kc = gl.arange(0, K, layout=gl.SliceLayout(0, ROWS_L))
        vc = jv * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, ROWS_L))
        ro = gl.arange(0, BT, layout=gl.SliceLayout(1, D_L))
        for ii in range(nc):
            i = nc - 1 - ii if BACKWARD else ii
            t0 = bos + i * BT
            r_ok = t0 + rr < eos
            rows = (t0 + rr).to(gl.int64) * H + hh
            last = gl.minimum(t0 + BT, eos) - 1
            if PER_CHANNEL:
                GLx = gl.load(G_ptr + (last.to(gl.int64) * H + hh) * K + kc)  # G_L along the rows' channels
            # lint: allow TP001 -- the state for stage 9, [NC, H, K, V], from its accumulator layout: a [K, BV] block of a row-major [K, V] state
            gl.store(s_ptr + ((c0 + i).to(gl.int64) * H + hh) * (K * V) + sblk, S.to(s_ptr.dtype.element_ty))
            sT_s.store(gl.permute(S, (1, 0)))
            if PER_CHANNEL:
                if BACKWARD:  # A = K * exp(G_L - G), in place once the tile is in (0 past the sequence)
                    if not A_LOADS:
                        mbarrier.wait(bar, ii & 1)
                    for half in gl.static_range(2):  # by halves of rows: a whole [64, K] tile and its gates spilled
                        hrows = t0 + half * (BT // 2) + rh
                        hoffs = hrows.to(gl.int64) * H + hh
                        a_half = a_s.slice(half * (BT // 2), BT // 2)
                        if A_LOADS:
                            # lint: allow TP001 -- 16-bit K widened and gated in registers on its way to A's fp32 slot (no room for a 16-bit TMA slot); rows past the sequence masked
                            k_half = gl.load(a_ptr + hoffs[:, None] * K + kc[None, :], mask=(hrows < eos)[:, None],
                                             other=0.0).to(gl.float32)
                        else:
                            k_half = a_half.load(ROWS_L)
                        a_half.store(k_half * _channel_decay(G_ptr, hoffs, hrows < eos, kc, GLx, K))
            fence_async_shared()
            gl.thread_barrier()  # every warp's part of S^T (and of the gated A), before the WGMMA reads it
            if not A_LOADS:
                mbarrier.wait(bar, ii & 1)
            aS = warpgroup_mma(a_s, sT_s.permute((1, 0)), gl.zeros([BT, BV], gl.float32, D_L), is_async=True)

            # under A S: the chunk's rows, and the transposed operands of the update (their last
            # readers, the previous chunk's WGMMAs, were waited for before the barrier that ended it)
            # (widened: KDA's W may come in bf16, BACKWARD_W_DTYPE)
            # lint: allow TP001 -- X goes to shared memory transposed (tokens contiguous, what tf32 WGMMA reads), which TMA cannot write
            x1 = gl.load(x1_ptr + rows[:, None] * K + kc[None, :], mask=r_ok[:, None], other=0.0).to(gl.float32)
            if PER_CHANNEL:
                if not BACKWARD:  # X1 = K * exp(G_L - G)
                    x1 = x1 * _channel_decay(G_ptr, rows, r_ok, kc, GLx, K)
            x1T_s.store(gl.permute(x1, (1, 0)))
            if BACKWARD:
                # lint: allow TP001 -- as X1
                x2 = gl.load(x2_ptr + rows[:, None] * K + kc[None, :], mask=r_ok[:, None], other=0.0).to(gl.float32)
                if PER_CHANNEL:  # X2 = Q * exp(G) (G loaded again, from L1/L2: not held across A S)
                    # lint: allow TP001 -- as the gates above
                    x2 = x2 * gl.exp(gl.load(G_ptr + rows[:, None] * K + kc[None, :], mask=r_ok[:, None],
                                             other=0.0).to(gl.float32))
                x2T_s.store(gl.permute(x2, (1, 0)))
                # lint: allow TP001 -- dO is scaled, widened to fp32 and transposed on its way to shared memory
                y2 = gl.load(y2_ptr + rows[:, None] * V + vc[None, :], mask=r_ok[:, None], other=0.0).to(gl.float32)
                if PER_CHANNEL:
                    y2 = y2 * scale
                else:
                    Gr = gl.load(G_ptr + rows, mask=r_ok, other=0.0)
                    y2 = y2 * (scale * gl.exp(Gr.to(gl.float32)))[:, None]
                y2T_s.store(gl.permute(y2, (1, 0)))
            o_ok = t0 + ro < eos
            orows = (t0 + ro).to(gl.int64) * H + hh
            if not PER_CHANNEL:
                Go = gl.load(G_ptr + orows, mask=o_ok, other=0.0)
                GL = gl.load(G_ptr + last.to(gl.int64) * H + hh)
                gate = gl.exp(gl.where(o_ok, (GL - Go).to(gl.float32), float("-inf")))  # exp(G_L - G), 0 past the sequence
            offs = orows[:, None] * V + (jv * BV + vcol)[None, :]
            # lint: allow TP001 -- the addend joins the accumulator in its own layout; rows past the sequence masked
            add = gl.load(add_ptr + offs, mask=o_ok[:, None], other=0.0).to(gl.float32)

            aS = warpgroup_mma_wait(0, deps=[aS])
            if BACKWARD:
                if PER_CHANNEL:
                    out = add + aS  # the gate is in A
                else:
                    out = add + aS * gate[:, None]
                y1 = -out  # the update accumulates W^T (-dVn)
            else:
                out = add - aS
                if PER_CHANNEL:
                    y1 = out  # the gate is in X1
                else:
                    y1 = out * gate[:, None]
            # rows past the sequence are 0 in Y by select, not by the gate's 0 alone: their A rows are
            # the next sequence's, and a non-finite value there would survive a product with 0
            y1 = gl.where(o_ok[:, None], y1, 0.0)
            # lint: allow TP001 -- a varlen chunk's tail rows belong to the next sequence: the masked store writes only this chunk's rows
            gl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=o_ok[:, None])
            # lint: allow TP005 -- y1T_s's readers (the previous chunk's update) were waited for (wait 0) by every warpgroup before the barrier that ended that chunk; the wait just above is A S's, which reads a_s and sT_s only
            y1T_s.store(gl.permute(y1, (1, 0)))
            fence_async_shared()
            gl.thread_barrier()  # every warp's operands are in, and every warpgroup has waited for A S
            if ii + 1 < nc and not A_LOADS:  # a_s is free (A S was its only reader): the next chunk's tile loads under the update
                nxt = t0 - BT if BACKWARD else t0 + BT
                mbarrier.expect(bar, a_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [nxt, hh * K], bar, a_s)
            if PER_CHANNEL:  # G_L along S's rows
                S = S * gl.exp(gl.load(G_ptr + (last.to(gl.int64) * H + hh) * K + kr).to(gl.float32))[:, None]
            else:
                S = S * gl.exp(GL.to(gl.float32))
            upd = warpgroup_mma(x1T_s, y1T_s.permute((1, 0)), S, is_async=True)
            if BACKWARD:
                upd = warpgroup_mma(x2T_s, y2T_s.permute((1, 0)), upd, is_async=True)
            S = warpgroup_mma_wait(0, deps=[upd])
            # every warpgroup's WGMMAs have read the shared operands before the next chunk rewrites
            # them (with two warpgroups also triton issue 11047's guard)
            gl.thread_barrier()
        if STORE_FINAL:
            # lint: allow TP001 -- once per program, after the chunk loop: the state from its accumulator layout
            gl.store(sfin_ptr + state + sblk, S)
        mbarrier.invalidate(bar)


    @gluon.jit
    def _dqkwg_state_block(a_do, h_b, dh_b, vn_s, dvn_s, q_ptr, k_ptr, G_ptr, dql_ptr, dkl_ptr, dq_ptr, dk_ptr, dw_ptr,
                           dG_ptr, bos, eos, hh, kb, H, scale, dG_stride, K: gl.constexpr, BKS: gl.constexpr):
        """9b for one block of BKS key columns, its tiles in shared memory (dO as `a_do`: fp32 in
        shared memory or a register A operand): dQa = dO h_c^T, dKs = Vn dh^T, dW = -dVn h_c^T by
        tf32 WGMMA issued together, sum(h_c * dh) formed while they run, then the epilogue's rows
        loaded (after the wait: loaded under the WGMMAs they cost 78 registers per thread at
        K = 128, and the loop form spilled) and dQ, dK, dW and the block's partial of dG stored
        (Triton's `_dqkwg_kernel` with DS_HERE False)."""
        BT: gl.constexpr = vn_s.shape[0]
        NW: gl.constexpr = gl.num_warps()
        D_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NW // 4],
                                                      instr_shape=[16, BKS // (NW // 4), 8])
        ROWS_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
        zero = gl.zeros([BT, BKS], gl.float32, D_L)
        dqa = warpgroup_mma(a_do, h_b.permute((1, 0)), zero, is_async=True)
        dks = warpgroup_mma(vn_s, dh_b.permute((1, 0)), zero, is_async=True)
        dwa = warpgroup_mma(dvn_s, h_b.permute((1, 0)), zero, is_async=True)

        ro = gl.arange(0, BT, layout=gl.SliceLayout(1, D_L))
        kcol = kb * BKS + gl.arange(0, BKS, layout=gl.SliceLayout(0, D_L))
        tok = bos + ro
        valid = tok < eos
        rows = tok.to(gl.int64) * H + hh
        offs = rows[:, None] * K + kcol[None, :]
        mk = valid[:, None]
        G = gl.load(G_ptr + rows, mask=valid, other=0.0)
        last = gl.minimum(bos + BT, eos) - 1
        GL = gl.load(G_ptr + last.to(gl.int64) * H + hh)
        hdh = 0.0  # sum(h_c * dh) over the block, from shared memory (the WGMMAs only read it)
        for half in gl.static_range(2):  # in two row halves: a whole [BKS, V] pair would hold 128 registers
            hdh += gl.sum(gl.sum(h_b.slice(half * (BKS // 2), BKS // 2).load(ROWS_L)
                                 * dh_b.slice(half * (BKS // 2), BKS // 2).load(ROWS_L), axis=1), axis=0)
        # every operand in deps: an operand whose last use is the WGMMA issue is free space to Triton's
        # shared-memory allocator, which placed the sum's reduction scratch on vn_s and h_s while the
        # WGMMAs still read them (found in the sm_90a PTX by a review, before any GPU run)
        dqa, dks, dwa, _a, _h, _dh, _vn, _dvn = warpgroup_mma_wait(0, deps=[dqa, dks, dwa, a_do, h_b, dh_b, vn_s, dvn_s])
        if NW > 4:
            gl.thread_barrier()  # every warpgroup's WGMMAs are done before anything reuses their operands (triton 11047)

        # lint: allow TP001 -- [64, BKS] epilogue tiles read in the accumulator layout they are combined in; rows past the sequence masked
        q = gl.load(q_ptr + offs, mask=mk, other=0.0)
        # lint: allow TP001 -- as q
        k = gl.load(k_ptr + offs, mask=mk, other=0.0)
        eg = gl.exp(G.to(gl.float32))
        decay = gl.exp(gl.where(valid, (GL - G).to(gl.float32), float("-inf")))
        # lint: allow TP001 -- as q
        dq = dqa * (scale * eg)[:, None] + gl.load(dql_ptr + offs, mask=mk, other=0.0)
        # lint: allow TP001 -- as q
        dk = dks * decay[:, None] + gl.load(dkl_ptr + offs, mask=mk, other=0.0)
        is_last = tok == last
        # exp(G_L - G_last) = 1 has no gradient: the last row's x is left out, not cancelled
        x = gl.where(is_last | ~valid, 0.0, decay * gl.sum(k * dks, axis=1))  # (past the sequence: its TMA rows)
        dG = scale * eg * gl.sum(q * dqa, axis=1) - x
        dG += gl.where(is_last, gl.exp(GL.to(gl.float32)) * hdh + gl.sum(x, axis=0), 0.0)
        # lint: allow TP001 -- a varlen chunk's tail rows belong to the next sequence: row-masked stores
        gl.store(dq_ptr + offs, dq.to(dq_ptr.dtype.element_ty), mask=mk)
        # lint: allow TP001 -- as dq
        gl.store(dk_ptr + offs, dk, mask=mk)
        # lint: allow TP001 -- as dq
        gl.store(dw_ptr + offs, -dwa, mask=mk)
        gl.store(dG_ptr + kb * dG_stride + rows, dG, mask=valid)

    @gluon.jit
    def _dqkwg_state_kernel(h_desc, dh_desc, vn_desc, dvn_desc, do_desc, q_ptr, k_ptr, G_ptr, dql_ptr, dkl_ptr, dq_ptr,
                            dk_ptr, dw_ptr, dG_ptr, chunks_ptr, H, scale, dG_stride, K: gl.constexpr,
                            V: gl.constexpr, BKS: gl.constexpr, KB_LOOP: gl.constexpr):
        """9b, the state part of stage 9 (Triton's `_dqkwg_kernel` with DS_HERE False; 9a, the
        chunk-local part, stays `_dqk_local_kernel`), with h_c and dh the states entering and
        leaving the chunk, per block of BKS key columns (`_dqkwg_state_block`):
            dQa = dO h_c^T,  dKs = Vn dh^T,  dW = -dVn h_c^T   (tf32 WGMMA, over V),
            hdh = sum(h_c * dh) over the block's rows of the state; then
            dQ = scale diag(exp(G)) dQa + dql,   dK = diag(exp(G_L - G)) dKs + dkl,
            dG = scale exp(G) rowsum(Q * dQa) - x (+ exp(G_L) hdh + sum(x) on the last valid row),
            x = exp(G_L - G) rowsum(K * dKs) (0 on the last valid row),
        dG as the block's partial. Every product contracts over V, along which all five operands
        are contiguous: each comes in by TMA as it is stored (h, dh as [BKS, V] row blocks of the
        [NC * H * K, V] states, read as transposed views: K-major, as tf32 needs); dO is bf16.
        KB_LOOP False: one program per (chunk, head, block), grid (NC * K / BKS, H), dO widened to
        fp32 in shared memory (176 KB at K = V = 128: one CTA per SM). KB_LOOP True: one program
        per (chunk, head), grid (NC, H), 8 warps, looping over the blocks: Vn, dVn and dO are loaded
        once (not once per block), dO goes to the WGMMAs as a register A operand (tf32 takes one:
        DotOperandLayout k_width 1), and the second block's h, dh load under the first block's
        WGMMAs (two buffer sets; 216 KB).
        Explicit here (Triton would choose): the mbarriers for the tiles, the widening or register
        staging of dO, the three WGMMAs issued together and waited for once. Rows past the
        sequence: the TMA rows of the next sequence (or zeros past the tensor) go through the
        row-wise products and the row-masked epilogue drops them."""
        BT: gl.constexpr = vn_desc.block_type.shape[0]
        NK: gl.constexpr = K // BKS
        gl.static_assert(not KB_LOOP or NK <= 2, "the loop form holds at most two key blocks (one buffer set each)")
        NB: gl.constexpr = 2 if KB_LOOP and NK > 1 else 1  # buffer sets for h, dh
        hh = gl.program_id(1)
        if KB_LOOP:
            c = gl.program_id(0)
            kb0 = 0
        else:
            c = gl.program_id(0) // NK
            kb0 = gl.program_id(0) % NK
        bos, eos = _chunk_bounds(chunks_ptr, c)

        ROWS_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [gl.num_warps(), 1], [1, 0])
        h_s = gl.allocate_shared_memory(gl.float32, [NB, BKS, V], h_desc.layout)
        dh_s = gl.allocate_shared_memory(gl.float32, [NB, BKS, V], dh_desc.layout)
        vn_s = gl.allocate_shared_memory(gl.float32, [BT, V], vn_desc.layout)
        dvn_s = gl.allocate_shared_memory(gl.float32, [BT, V], dvn_desc.layout)
        do_s = gl.allocate_shared_memory(do_desc.dtype, [BT, V], do_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(NB):
            mbarrier.init(bars.index(b), count=1)
        fence_async_shared()
        ROW_BYTES: gl.constexpr = vn_desc.block_type.nbytes + dvn_desc.block_type.nbytes + do_desc.block_type.nbytes
        STATE_BYTES: gl.constexpr = h_desc.block_type.nbytes + dh_desc.block_type.nbytes
        sbase = (c * H + hh) * K  # the chunk's first row of h_c in [NC * H * K, V]
        mbarrier.expect(bars.index(0), ROW_BYTES + STATE_BYTES)  # the rows ride with the first block
        tma.async_copy_global_to_shared(vn_desc, [bos, hh * V], bars.index(0), vn_s)
        tma.async_copy_global_to_shared(dvn_desc, [bos, hh * V], bars.index(0), dvn_s)
        tma.async_copy_global_to_shared(do_desc, [bos, hh * V], bars.index(0), do_s)
        tma.async_copy_global_to_shared(h_desc, [sbase + kb0 * BKS, 0], bars.index(0), h_s.index(0))
        tma.async_copy_global_to_shared(dh_desc, [sbase + kb0 * BKS, 0], bars.index(0), dh_s.index(0))
        if NB == 2:
            mbarrier.expect(bars.index(1), STATE_BYTES)
            tma.async_copy_global_to_shared(h_desc, [sbase + BKS, 0], bars.index(1), h_s.index(1))
            tma.async_copy_global_to_shared(dh_desc, [sbase + BKS, 0], bars.index(1), dh_s.index(1))
        mbarrier.wait(bars.index(0), 0)
        if KB_LOOP:
            WG: gl.constexpr = gl.num_warps() // 4
            D_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                          instr_shape=[16, BKS // WG, 8])
            for kb in gl.static_range(NK):  # NK <= 2 (K <= 128, BKS 64): each block has its own buffer set
                if kb > 0:
                    mbarrier.wait(bars.index(kb), 0)
                # dO into registers again per block (from shared memory: cheap), so that it is not
                # held through the epilogues
                a_do = gl.convert_layout(do_s.load(ROWS_L).to(gl.float32),
                                         gl.DotOperandLayout(operand_index=0, parent=D_L, k_width=1))
                _dqkwg_state_block(a_do, h_s.index(kb), dh_s.index(kb), vn_s, dvn_s, q_ptr, k_ptr, G_ptr, dql_ptr,
                                   dkl_ptr, dq_ptr, dk_ptr, dw_ptr, dG_ptr, bos, eos, hh, kb, H, scale, dG_stride, K,
                                   BKS)
        else:
            do32_s = gl.allocate_shared_memory(gl.float32, [BT, V], vn_desc.layout)
            # lint: allow TP005 -- written once, before any WGMMA of this program (the wait the lint sees is in the block helper)
            do32_s.store(do_s.load(ROWS_L).to(gl.float32))
            fence_async_shared()
            gl.thread_barrier()  # every warp's part of dO in fp32, before the WGMMA reads it
            _dqkwg_state_block(do32_s, h_s.index(0), dh_s.index(0), vn_s, dvn_s, q_ptr, k_ptr, G_ptr, dql_ptr, dkl_ptr,
                               dq_ptr, dk_ptr, dw_ptr, dG_ptr, bos, eos, hh, kb0, H, scale, dG_stride, K, BKS)
        for b in gl.static_range(NB):
            mbarrier.invalidate(bars.index(b))

    @gluon.jit
    def _load_chunk_rows(a_desc, b_desc, c_desc, bos, a_col, b_col, c_col, bar, a_s, b_s, c_s):
        """TMA one chunk's rows (from token bos) of three [Ntok, H * D] tensors, at the head's columns
        a_col, b_col, c_col, into a_s, b_s, c_s, all three on `bar`, armed with their bytes."""
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes + c_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [bos, a_col], bar, a_s)
        tma.async_copy_global_to_shared(b_desc, [bos, b_col], bar, b_s)
        tma.async_copy_global_to_shared(c_desc, [bos, c_col], bar, c_s)

    @gluon.jit
    def _transposed_rows(t_ptr, rows, r_ok, cc, A_L: gl.constexpr):
        """T^T of one chunk and head as a register A operand of a WGMMA with accumulator layout A_L:
        T's [64, 64] rows (row offsets `rows`, masked by `r_ok` past the sequence) loaded and
        transposed, which TMA cannot give."""
        BT: gl.constexpr = cc.shape[0]
        # lint: allow TP001 -- T's rows, masked past the sequence, go to registers transposed (an A operand), which TMA cannot give
        t = gl.load(t_ptr + rows * BT + cc[None, :], mask=r_ok, other=0.0)
        return gl.convert_layout(gl.permute(t, (1, 0)), gl.DotOperandLayout(operand_index=0, parent=A_L, k_width=1))

    @gluon.jit
    def _store_transposed(dst_s, ptr, rows, cols, r_ok, D: gl.constexpr):
        """A [64, n] row tile (row offsets `rows` [64, 1] of a [.., D] tensor, columns `cols`,
        masked by `r_ok` past the sequence) into shared memory transposed: tokens contiguous, as
        tf32 WGMMA reads an operand that contracts over the chunk's tokens (TMA cannot write it); a
        16-bit tile (KDA's dVn in bf16, BACKWARD_DSTATES_DTYPE) widened to the slot's dtype."""
        # lint: allow TP001 -- the tile goes to shared memory transposed, which TMA cannot write; rows past the sequence masked
        tile = gl.load(ptr + rows * D + cols[None, :], mask=r_ok, other=0.0).to(dst_s.dtype)
        dst_s.store(gl.permute(tile, (1, 0)))

    @gluon.jit
    def _dv_rows(dup, beta, dv_ptr, v_ptr, offs, o_ok):
        """dV = diag(beta) dU' stored (rows past the sequence masked), and rowsum(V * dU') returned:
        stage 10's uses of dU' beside dA."""
        # lint: allow TP001 -- rows in the accumulator layout they are combined in; a varlen tail's rows masked
        gl.store(dv_ptr + offs, (dup * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=o_ok[:, None])
        # lint: allow TP001 -- as dV
        return gl.sum(gl.load(v_ptr + offs, mask=o_ok[:, None], other=0.0).to(gl.float32) * dup, axis=1)

    @gluon.jit
    def _symmetric_operand(Bm, parent: gl.constexpr):
        """B + B^T ([64, 64], one accumulator layout) as a register A operand of a WGMMA whose
        accumulator layout is `parent`: dK's (B + B^T) K in one product."""
        return gl.convert_layout(Bm + gl.convert_layout(gl.permute(Bm, (1, 0)), Bm.type.layout),
                                 gl.DotOperandLayout(operand_index=0, parent=parent, k_width=1))

    @gluon.jit
    def _wy_bwd_gate_terms(dA, kk, vdu, kdw, beta, eg, G, G_ptr, dGp_ptr, dbeta_ptr, dg_ptr, bos, eos, hh, H,
                           dGp_stride, NKP: gl.constexpr):
        """Stage 10's terms from dA (= dU' U^T + dW' W^T, not yet negated) and K K^T, both [64, 64]
        in one accumulator layout, with the rows' rowsum(V * dU') (vdu), rowsum(K * dW') (kdw),
        beta, exp(G) and G: B = diag(beta) (-dA * Gam) on the strict lower triangle of valid rows,
        returned; dbeta and dg (dG summed in reverse over the chunk, 9's NKP partials added) stored."""
        A_L: gl.constexpr = dA.type.layout
        BT: gl.constexpr = dA.shape[0]
        NW: gl.constexpr = gl.num_warps()
        ri = gl.arange(0, BT, layout=gl.SliceLayout(1, A_L))
        cj = gl.arange(0, BT, layout=gl.SliceLayout(0, A_L))
        i_ok = bos + ri < eos
        j_ok = bos + cj < eos
        Gi = gl.convert_layout(G, gl.SliceLayout(1, A_L))
        Gj = gl.load(G_ptr + (bos + cj).to(gl.int64) * H + hh, mask=j_ok, other=0.0)
        m = (ri[:, None] > cj[None, :]) & i_ok[:, None] & j_ok[None, :]
        gam = gl.exp(gl.where(m, (Gi[:, None] - Gj[None, :]).to(gl.float32), float("-inf")))
        dAg = gl.where(m, -dA * gam, 0.0)
        betai = gl.convert_layout(beta, gl.SliceLayout(1, A_L))
        Bm = dAg * betai[:, None]
        Mk = Bm * kk
        egi = gl.convert_layout(eg, gl.SliceLayout(1, A_L))
        kdwi = gl.convert_layout(kdw, gl.SliceLayout(1, A_L))
        dbeta = gl.convert_layout(vdu, gl.SliceLayout(1, A_L)) + egi * kdwi + gl.sum(dAg * kk, axis=1)
        dG = betai * egi * kdwi + gl.sum(Mk, axis=1) - gl.convert_layout(gl.sum(Mk, axis=0), gl.SliceLayout(1, A_L))
        rowi = (bos + ri).to(gl.int64) * H + hh
        for p in gl.static_range(NKP):
            dG += gl.load(dGp_ptr + p * dGp_stride + rowi, mask=i_ok, other=0.0)
        gl.store(dbeta_ptr + rowi, dbeta.to(dbeta_ptr.dtype.element_ty), mask=i_ok)
        # the scan in a plain 1D layout (triton 3.6 lowers no scan over a slice of the WGMMA layout)
        SCAN_L: gl.constexpr = gl.BlockedLayout([BT // 32], [32], [NW], [0])  # each warp scans all 64 rows
        dg = gl.associative_scan(gl.convert_layout(dG, SCAN_L), 0, _sum_combine, reverse=True)
        rs = gl.arange(0, BT, layout=SCAN_L)
        gl.store(dg_ptr + (bos + rs).to(gl.int64) * H + hh, dg.to(dg_ptr.dtype.element_ty), mask=bos + rs < eos)
        return Bm

    @gluon.jit
    def _wy_bwd_tf32_kernel(u_desc, w_desc, k_desc, t_ptr, dw_ptr, dvn_ptr, v_ptr, beta_ptr, G_ptr, dkp_ptr, dGp_ptr,
                            dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, chunks_ptr, kraw_ptr, H, dGp_stride, eps,
                            K: gl.constexpr, V: gl.constexpr, NKP: gl.constexpr, L2NORM_K: gl.constexpr):
        """10, back through W, U, T and A (Triton's `_wy_bwd_kernel`), for one chunk and head per
        program, grid (NC, H), 4 or 8 warps (one or two warpgroups side by side along N); every
        product a tf32 WGMMA on fp32 operands:
            dU' = T^T dVn,  dW' = T^T dW,  kk = K K^T                      (issued together)
            dA = strict_lower(-(dU' U^T + dW' W^T))                        (dU', dW' from registers)
            dV = diag(beta) dU',  B = diag(beta) (dA * Gam),  M = B * kk
            dbeta = rowsum(V * dU') + exp(G) rowsum(K * dW') + rowsum(dA * Gam * kk)
            dG = beta exp(G) rowsum(K * dW') + rowsum(M) - colsum(M) + the NKP partials of 9
            dg = dG summed in reverse over the chunk
            dK = dK of 9 + diag(beta exp(G)) dW' + (B + B^T) K            (onto that accumulator)
        Explicit here (Triton would choose): tf32 WGMMA reads both operands K-major, so the
        products are arranged to contract along rows where the operands are stored that way: U, W
        and K come by TMA and serve as they are (dA's B operands, and both sides of K K^T); T^T,
        dU', dW' and B + B^T are register A operands; dVn, dW and K, which meet contractions over
        the chunk's tokens, are written to shared memory transposed. Triton's kernel forms dA^T
        apart, in bf16, to avoid transposes; here B^T is B's transpose in registers, and the two
        key-side products are one. Rows past the chunk's sequence (a varlen tail: the TMA rows of
        the next sequence, finite) meet only masked factors: T, dVn, dW, beta, G and dK's rows are
        loaded masked, dA's by the strict-lower mask.
        L2NORM_K: K is the l2-normalised raw keys (use_qk_l2norm_in_kernel), and dK leaves through
        the normalisation's backward (Triton's `_l2norm_bwd_kernel`, stage 11, for k): with y the
        normalised row recomputed from the raw one, rstd = 1 / sqrt(sum(k^2) + eps),
            dk = rstd (dK - y rowsum(dK * y))
        in dk's dtype, so dK's fp32 round trip and that launch go."""
        BT: gl.constexpr = u_desc.block_type.shape[0]
        gl.static_assert(K == V, "dVn^T and K^T share one shared-memory buffer")
        NW: gl.constexpr = gl.num_warps()
        WG: gl.constexpr = NW // 4
        c = gl.program_id(0)
        hh = gl.program_id(1)
        bos, eos = _chunk_bounds(chunks_ptr, c)

        D_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, V // WG, 8])  # [64, K] and [64, V]
        A_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, BT // WG, 8])  # [64, 64]
        ROWS_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
        XT_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, BT], gl.float32)
        u_s = gl.allocate_shared_memory(gl.float32, [BT, V], u_desc.layout)
        w_s = gl.allocate_shared_memory(gl.float32, [BT, K], w_desc.layout)
        k_s = gl.allocate_shared_memory(gl.float32, [BT, K], k_desc.layout)
        xT_s = gl.allocate_shared_memory(gl.float32, [K, BT], XT_SL)  # dVn^T, then K^T
        dwT_s = gl.allocate_shared_memory(gl.float32, [K, BT], XT_SL)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        fence_async_shared()
        _load_chunk_rows(u_desc, w_desc, k_desc, bos, hh * V, hh * K, hh * K, bar, u_s, w_s, k_s)

        # under the TMA loads: T^T as a register operand, dVn^T and dW^T into shared memory
        rr = gl.arange(0, BT, layout=gl.SliceLayout(1, ROWS_L))
        cc = gl.arange(0, K, layout=gl.SliceLayout(0, ROWS_L))
        tc = gl.arange(0, BT, layout=gl.SliceLayout(0, ROWS_L))
        r_ok = (bos + rr < eos)[:, None]
        rows = ((bos + rr).to(gl.int64) * H + hh)[:, None]
        a_tT = _transposed_rows(t_ptr, rows, r_ok, tc, D_L)
        _store_transposed(xT_s, dvn_ptr, rows, cc, r_ok, V)
        _store_transposed(dwT_s, dw_ptr, rows, cc, r_ok, K)
        fence_async_shared()
        gl.thread_barrier()  # every warp's part of dVn^T and dW^T, before the WGMMAs read them
        mbarrier.wait(bar, 0)
        zero = gl.zeros([BT, K], gl.float32, D_L)
        dup = warpgroup_mma(a_tT, xT_s.permute((1, 0)), zero, is_async=True)
        dwp = warpgroup_mma(a_tT, dwT_s.permute((1, 0)), zero, is_async=True)
        kk = warpgroup_mma(k_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_L), is_async=True)

        ro = gl.arange(0, BT, layout=gl.SliceLayout(1, D_L))
        col = gl.arange(0, K, layout=gl.SliceLayout(0, D_L))
        o_ok = bos + ro < eos
        orows = (bos + ro).to(gl.int64) * H + hh
        beta = gl.load(beta_ptr + orows, mask=o_ok, other=0.0).to(gl.float32)
        G = gl.load(G_ptr + orows, mask=o_ok, other=0.0)
        eg = gl.exp(G.to(gl.float32))
        # every operand in deps (an operand's shared memory is otherwise free to the allocator)
        dup, dwp, kk, _t, _x, _dw, _k = warpgroup_mma_wait(0, deps=[dup, dwp, kk, a_tT, xT_s, dwT_s, k_s])
        if NW > 4:
            gl.thread_barrier()  # every warpgroup is done with xT_s before it is rewritten (triton 11047)

        # dA from registers, dU' U^T issued as soon as dU' has given dV and rowsum(V * dU') (so that
        # dU' and its operand copy are not live together with dW''s), then dW' W^T
        offs = orows[:, None] * V + col[None, :]
        # lint: allow TP001 -- dV and V's [64, V] rows in the accumulator layout they are combined in (TMA would add a shared-memory round trip); a varlen tail's rows masked
        vdu = _dv_rows(dup, beta, dv_ptr, v_ptr, offs, o_ok)
        a_dup = gl.convert_layout(dup, gl.DotOperandLayout(operand_index=0, parent=A_L, k_width=1))
        dA = warpgroup_mma(a_dup, u_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_L), is_async=True)
        kr = k_s.load(ROWS_L)
        kdw = gl.sum(gl.convert_layout(kr, D_L) * dwp, axis=1)
        xT_s.store(gl.permute(kr, (1, 0)))  # K^T, for dK's product
        fence_async_shared()
        # lint: allow TP001 -- as dV
        dk = gl.load(dkp_ptr + offs, mask=o_ok[:, None], other=0.0) + dwp * (beta * eg)[:, None]
        # dU''s operand copy retires before dW''s is made: both live at once spill (sm_90a, K = 128)
        dA, _a, _u = warpgroup_mma_wait(0, deps=[dA, a_dup, u_s])
        if NW > 4:
            gl.thread_barrier()  # u_s is free to the allocator now: every warpgroup's read of it is done (triton 11047)
        a_dwp = gl.convert_layout(dwp, gl.DotOperandLayout(operand_index=0, parent=A_L, k_width=1))
        dA = warpgroup_mma(a_dwp, w_s.permute((1, 0)), dA, is_async=True)
        dA, _b, _w = warpgroup_mma_wait(0, deps=[dA, a_dwp, w_s])
        if NW > 4:
            gl.thread_barrier()  # as after the first: w_s is free now

        # lint: allow TP001 -- the helper moves [64] rows only (G, 9's dG partials, dbeta, dg); the lint's shape inference takes a 2D tile from this caller
        Bm = _wy_bwd_gate_terms(dA, kk, vdu, kdw, beta, eg, G, G_ptr, dGp_ptr, dbeta_ptr, dg_ptr, bos, eos, hh, H,
                                dGp_stride, NKP)

        # dK += (B + B^T) K, onto the accumulator that holds 9's dK and diag(beta exp(G)) dW'
        a_s = _symmetric_operand(Bm, D_L)
        gl.thread_barrier()  # every warp's part of K^T is in xT_s (fenced above)
        dk = warpgroup_mma(a_s, xT_s.permute((1, 0)), dk, is_async=True)
        dk, _s, _x = warpgroup_mma_wait(0, deps=[dk, a_s, xT_s])
        koffs = orows[:, None] * K + col[None, :]
        if L2NORM_K:
            if NW > 4:
                # the row sums below reduce across the warpgroups through shared-memory scratch, and
                # xT_s, free to the allocator after the wait, may still be read by the other's WGMMA
                gl.thread_barrier()
            # lint: allow TP001 -- the raw keys' rows in the accumulator layout dK is in; a varlen tail's rows masked
            kraw = gl.load(kraw_ptr + koffs, mask=o_ok[:, None], other=0.0).to(gl.float32)
            rstd = gl.rsqrt(gl.sum(kraw * kraw, axis=1) + eps)
            y = kraw * rstd[:, None]
            dk = rstd[:, None] * (dk - y * gl.sum(dk * y, axis=1)[:, None])
        # lint: allow TP001 -- as dV
        gl.store(dk_ptr + koffs, dk.to(dk_ptr.dtype.element_ty), mask=o_ok[:, None])
        mbarrier.invalidate(bar)

    @gluon.jit
    def _wy_bwd_halves_kernel(u_desc, w_desc, k_desc, t_ptr, dw_ptr, dvn_ptr, v_ptr, beta_ptr, G_ptr, dkp_ptr,
                              dGp_ptr, dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, chunks_ptr, H, dGp_stride,
                              K: gl.constexpr, V: gl.constexpr, NKP: gl.constexpr):
        """Stage 10 as `_wy_bwd_tf32_kernel` computes it, in column blocks of HB (the TMA block's
        width, 64) so that a program holds [64, 64] fp32 tiles only: ~100 KB of shared memory on
        4 warps, two programs per SM where the whole-width kernel (176 KB) runs one. Grid (NC, H).
            pass 1, each block h of V and K:  dU'_h = T^T dVn_h,  dW'_h = T^T dW_h,
                dV_h stored,  dA += dU'_h U_h^T + dW'_h W_h^T,  kk += K_h K_h^T,
                rowsum(V * dU') and rowsum(K * dW') accumulated;
            the gate terms (`_wy_bwd_gate_terms`): B, dbeta, dg;
            pass 2, each block h of K:  dK_h = dK of 9 + diag(beta exp(G)) dW'_h + (B + B^T) K_h,
                with dW'_h formed again and K_h loaded again (B needs all of dA first).
        Explicit here (Triton would choose): the blocking and the second pass (more loads, fewer
        bytes of shared memory and registers per program); the rest as in the whole-width kernel."""
        BT: gl.constexpr = u_desc.block_type.shape[0]
        HB: gl.constexpr = u_desc.block_type.shape[1]
        gl.static_assert(K == V and K % HB == 0, "the blocks of K and V pair up")
        gl.static_assert(HB == BT, "one column index serves T's rows and a block's")
        NH: gl.constexpr = K // HB
        NW: gl.constexpr = gl.num_warps()
        WG: gl.constexpr = NW // 4
        c = gl.program_id(0)
        hh = gl.program_id(1)
        bos, eos = _chunk_bounds(chunks_ptr, c)

        A_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, HB // WG, 8])  # every tile is [64, 64]
        ROWS_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
        XT_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HB, BT], gl.float32)
        u_s = gl.allocate_shared_memory(gl.float32, [BT, HB], u_desc.layout)
        w_s = gl.allocate_shared_memory(gl.float32, [BT, HB], w_desc.layout)
        k_s = gl.allocate_shared_memory(gl.float32, [BT, HB], k_desc.layout)
        xT_s = gl.allocate_shared_memory(gl.float32, [HB, BT], XT_SL)  # dVn_h^T in pass 1, K_h^T in pass 2
        dwT_s = gl.allocate_shared_memory(gl.float32, [HB, BT], XT_SL)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        fence_async_shared()

        rr = gl.arange(0, BT, layout=gl.SliceLayout(1, ROWS_L))
        cc = gl.arange(0, HB, layout=gl.SliceLayout(0, ROWS_L))
        r_ok = (bos + rr < eos)[:, None]
        rows = ((bos + rr).to(gl.int64) * H + hh)[:, None]
        ro = gl.arange(0, BT, layout=gl.SliceLayout(1, A_L))
        col = gl.arange(0, HB, layout=gl.SliceLayout(0, A_L))
        o_ok = bos + ro < eos
        orows = (bos + ro).to(gl.int64) * H + hh
        beta = gl.load(beta_ptr + orows, mask=o_ok, other=0.0).to(gl.float32)
        G = gl.load(G_ptr + orows, mask=o_ok, other=0.0)
        eg = gl.exp(G.to(gl.float32))
        zero = gl.zeros([BT, HB], gl.float32, A_L)
        kk = zero
        dA = zero
        vdu = gl.zeros([BT], gl.float32, gl.SliceLayout(1, A_L))
        kdw = gl.zeros([BT], gl.float32, gl.SliceLayout(1, A_L))
        for h in gl.static_range(NH):  # pass 1
            _load_chunk_rows(u_desc, w_desc, k_desc, bos, hh * V + h * HB, hh * K + h * HB, hh * K + h * HB, bar, u_s,
                             w_s, k_s)
            _store_transposed(xT_s, dvn_ptr, rows, h * HB + cc, r_ok, V)
            _store_transposed(dwT_s, dw_ptr, rows, h * HB + cc, r_ok, K)
            fence_async_shared()
            gl.thread_barrier()  # every warp's part of dVn_h^T and dW_h^T, before the WGMMAs read them
            mbarrier.wait(bar, h & 1)
            # one [64, 64] product in flight beside kk at a time, T^T loaded for each where used:
            # every tile held through the block is 32 registers per thread on 4 warps
            a_tT = _transposed_rows(t_ptr, rows, r_ok, cc, A_L)
            dup = warpgroup_mma(a_tT, xT_s.permute((1, 0)), zero, is_async=True)
            kk = warpgroup_mma(k_s, k_s.permute((1, 0)), kk, is_async=True)
            dup, kk, _t, _x, _k = warpgroup_mma_wait(0, deps=[dup, kk, a_tT, xT_s, k_s])
            if NW > 4:
                gl.thread_barrier()  # triton 11047: scratch may reuse what the other warpgroup still reads
            # lint: allow TP001 -- as in `_wy_bwd_tf32_kernel`: dV and V's rows in the accumulator layout; a varlen tail's rows masked
            vdu += _dv_rows(dup, beta, dv_ptr, v_ptr, orows[:, None] * V + (h * HB + col)[None, :], o_ok)
            a_dup = gl.convert_layout(dup, gl.DotOperandLayout(operand_index=0, parent=A_L, k_width=1))
            dA = warpgroup_mma(a_dup, u_s.permute((1, 0)), dA, is_async=True)
            dA, _a, _u = warpgroup_mma_wait(0, deps=[dA, a_dup, u_s])
            if NW > 4:
                gl.thread_barrier()  # as above: u_s is free to the allocator now
            a_tT = _transposed_rows(t_ptr, rows, r_ok, cc, A_L)
            dwp = warpgroup_mma(a_tT, dwT_s.permute((1, 0)), zero, is_async=True)
            dwp, _t, _dw = warpgroup_mma_wait(0, deps=[dwp, a_tT, dwT_s])
            if NW > 4:
                gl.thread_barrier()  # as above: dwT_s is free now
            kdw += gl.sum(k_s.load(A_L) * dwp, axis=1)
            a_dwp = gl.convert_layout(dwp, gl.DotOperandLayout(operand_index=0, parent=A_L, k_width=1))
            dA = warpgroup_mma(a_dwp, w_s.permute((1, 0)), dA, is_async=True)
            dA, _b, _w = warpgroup_mma_wait(0, deps=[dA, a_dwp, w_s])
            gl.thread_barrier()  # every warp(group) is done with this block's buffers before the next block's land (triton 11047)

        # lint: allow TP001 -- the helper moves [64] rows only (G, 9's dG partials, dbeta, dg); the lint's shape inference takes a 2D tile from this caller
        Bm = _wy_bwd_gate_terms(dA, kk, vdu, kdw, beta, eg, G, G_ptr, dGp_ptr, dbeta_ptr, dg_ptr, bos, eos, hh, H,
                                dGp_stride, NKP)
        a_s = _symmetric_operand(Bm, A_L)
        for h in gl.static_range(NH):  # pass 2
            mbarrier.expect(bar, k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [bos, hh * K + h * HB], bar, k_s)
            _store_transposed(dwT_s, dw_ptr, rows, h * HB + cc, r_ok, K)
            fence_async_shared()
            gl.thread_barrier()  # every warp's part of dW_h^T
            a_tT = _transposed_rows(t_ptr, rows, r_ok, cc, A_L)
            dwp = warpgroup_mma(a_tT, dwT_s.permute((1, 0)), zero, is_async=True)
            offs = orows[:, None] * K + (h * HB + col)[None, :]
            # lint: allow TP001 -- as dV in pass 1
            dkp = gl.load(dkp_ptr + offs, mask=o_ok[:, None], other=0.0)
            mbarrier.wait(bar, (NH + h) & 1)
            xT_s.store(gl.permute(k_s.load(ROWS_L), (1, 0)))  # K_h^T
            fence_async_shared()
            dwp, _t2, _dw2 = warpgroup_mma_wait(0, deps=[dwp, a_tT, dwT_s])
            gl.thread_barrier()  # every warp's part of K_h^T; every warpgroup past its WGMMA (triton 11047)
            dk = warpgroup_mma(a_s, xT_s.permute((1, 0)), dkp + dwp * (beta * eg)[:, None], is_async=True)
            dk, _s, _x = warpgroup_mma_wait(0, deps=[dk, a_s, xT_s])
            # lint: allow TP001 -- as dV in pass 1
            gl.store(dk_ptr + offs, dk.to(dk_ptr.dtype.element_ty), mask=o_ok[:, None])
            gl.thread_barrier()  # every warp is done with k_s, xT_s, dwT_s before the next block's land
        mbarrier.invalidate(bar)

    @gluon.jit
    def _sum_combine(a, b):
        """associative_scan's combine for a running sum."""
        return a + b

    @gluon.jit
    def _dqk_local_tf32_kernel(q_desc, k_desc, vn_desc, do_ptr, G_ptr, dql_ptr, dkl_ptr, dG_ptr, dvl_ptr, chunks_ptr, H,
                               scale, K: gl.constexpr, V: gl.constexpr, DV_LOCAL: gl.constexpr):
        """9a, the chunk-local part of stage 9 (Triton's `_dqk_local_kernel`), one chunk and head
        per program, grid (NC, H), 8 warps (two warpgroups side by side along N); tf32 WGMMA on
        fp32 operands:
            dS = dO Vn^T,  Q K^T                         (issued together)
            D = lower(scale dS * Gam),  dG's D' terms rowsum(D' * QK^T) - colsum(D' * QK^T)
            dql = D K,  dkl = D^T Q                       (fp32, for 9b's epilogue)
        with D' = D off the diagonal (its own partial of dG). DV_LOCAL: stage 7 as well, from the
        same Q K^T and dO (one launch instead of two, which loaded and formed both apart):
            dVl = scale lower(Q K^T * Gam)^T dO          (fp32, for stage 8)
        with P^T a register transpose and dO^T (fp32) written to shared memory (200 KB in all).
        Explicit here (Triton would choose): q, k and Vn come by TMA and serve as they are where
        the contraction runs along their rows (Vn for dS, q and k for Q K^T); dO is widened to
        fp32 on its way to a register A operand; D and D^T are register A operands (D^T a
        transpose in registers: Triton's kernel forms dS^T = Vn dO^T apart instead, because
        tl.trans of a dot result feeding a dot is what triton 3.4-3.7.0 miscompiles on Hopper,
        FLA issue 640; here the layouts are explicit and the gate checks the result); K and Q,
        which meet contractions over the chunk's tokens, are written to shared memory transposed
        while dS and Q K^T run. Rows past the sequence (a varlen tail: the next sequence's TMA
        rows, finite) meet only D's mask."""
        BT: gl.constexpr = vn_desc.block_type.shape[0]
        NW: gl.constexpr = gl.num_warps()
        WG: gl.constexpr = NW // 4
        c = gl.program_id(0)
        hh = gl.program_id(1)
        bos, eos = _chunk_bounds(chunks_ptr, c)

        D_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, K // WG, 8])  # [64, K]
        A_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, BT // WG, 8])  # [64, 64]
        ROWS_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
        XT_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, BT], gl.float32)
        q_s = gl.allocate_shared_memory(gl.float32, [BT, K], q_desc.layout)
        k_s = gl.allocate_shared_memory(gl.float32, [BT, K], k_desc.layout)
        vn_s = gl.allocate_shared_memory(gl.float32, [BT, V], vn_desc.layout)
        qT_s = gl.allocate_shared_memory(gl.float32, [K, BT], XT_SL)
        kT_s = gl.allocate_shared_memory(gl.float32, [K, BT], XT_SL)
        if DV_LOCAL:
            doT_s = gl.allocate_shared_memory(gl.float32, [V, BT], gl.NVMMASharedLayout.get_default_for([V, BT],
                                                                                                      gl.float32))
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        fence_async_shared()
        _load_chunk_rows(q_desc, k_desc, vn_desc, bos, hh * K, hh * K, hh * V, bar, q_s, k_s, vn_s)

        rr = gl.arange(0, BT, layout=gl.SliceLayout(1, ROWS_L))
        vc = gl.arange(0, V, layout=gl.SliceLayout(0, ROWS_L))
        rows = ((bos + rr).to(gl.int64) * H + hh)[:, None]
        # lint: allow TP001 -- dO (bf16) is widened to fp32 on its way to a register A operand, which TMA cannot give; rows past the sequence masked
        do = gl.load(do_ptr + rows * V + vc[None, :], mask=(bos + rr < eos)[:, None], other=0.0).to(gl.float32)
        a_do = gl.convert_layout(do, gl.DotOperandLayout(operand_index=0, parent=A_L, k_width=1))
        if DV_LOCAL:
            doT_s.store(gl.permute(do, (1, 0)))  # fenced with Q^T and K^T below; read after the barrier
        mbarrier.wait(bar, 0)
        zero = gl.zeros([BT, BT], gl.float32, A_L)
        ds = warpgroup_mma(a_do, vn_s.permute((1, 0)), zero, is_async=True)
        qk = warpgroup_mma(q_s, k_s.permute((1, 0)), zero, is_async=True)
        # under them: Q^T and K^T into shared memory (the WGMMAs only read q_s and k_s)
        qT_s.store(gl.permute(q_s.load(ROWS_L), (1, 0)))
        kT_s.store(gl.permute(k_s.load(ROWS_L), (1, 0)))
        fence_async_shared()
        ri = gl.arange(0, BT, layout=gl.SliceLayout(1, A_L))
        cj = gl.arange(0, BT, layout=gl.SliceLayout(0, A_L))
        i_ok = bos + ri < eos
        j_ok = bos + cj < eos
        rowi = (bos + ri).to(gl.int64) * H + hh
        Gi = gl.load(G_ptr + rowi, mask=i_ok, other=0.0)
        Gj = gl.load(G_ptr + (bos + cj).to(gl.int64) * H + hh, mask=j_ok, other=0.0)
        # every operand in deps (an operand's shared memory is otherwise free to the allocator)
        ds, qk, _d, _v, _q, _k = warpgroup_mma_wait(0, deps=[ds, qk, a_do, vn_s, q_s, k_s])
        gl.thread_barrier()  # every warp's part of Q^T and K^T is in; every warpgroup is past its WGMMAs (triton 11047)

        m = (ri[:, None] >= cj[None, :]) & i_ok[:, None] & j_ok[None, :]
        gam = gl.exp(gl.where(m, (Gi[:, None] - Gj[None, :]).to(gl.float32), float("-inf")))
        D = gl.where(m, ds * gam * scale, 0.0)
        a_D = gl.convert_layout(D, gl.DotOperandLayout(operand_index=0, parent=D_L, k_width=1))
        dql = warpgroup_mma(a_D, kT_s.permute((1, 0)), gl.zeros([BT, K], gl.float32, D_L), is_async=True)
        a_Dt = gl.convert_layout(gl.permute(D, (1, 0)), gl.DotOperandLayout(operand_index=0, parent=D_L, k_width=1))
        dkl = warpgroup_mma(a_Dt, qT_s.permute((1, 0)), gl.zeros([BT, K], gl.float32, D_L), is_async=True)
        # under them: dG's D' terms (the diagonal of Gam has no gradient: `_d_prime_dG`)
        M = gl.where(ri[:, None] > cj[None, :], D * qk, 0.0)
        dG = gl.sum(M, axis=1) - gl.convert_layout(gl.sum(M, axis=0), gl.SliceLayout(1, A_L))
        gl.store(dG_ptr + rowi, dG, mask=i_ok)
        dql, dkl, _a, _b, _kt, _qt = warpgroup_mma_wait(0, deps=[dql, dkl, a_D, a_Dt, kT_s, qT_s])
        if DV_LOCAL:
            # stage 7 after 9a's products have retired (their operands and accumulators not live
            # beside P^T's): P^T = (Q K^T)^T * Gam^T on t >= s, a register A operand. The layout
            # conversions use shared-memory scratch, which may land on kT_s or qT_s: every
            # warpgroup's WGMMAs are done with them first (triton 11047)
            gl.thread_barrier()
            DV_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                           instr_shape=[16, V // WG, 8])
            mT = (ri[:, None] <= cj[None, :]) & i_ok[:, None] & j_ok[None, :]
            gamT = gl.exp(gl.where(mT, (Gj[None, :] - Gi[:, None]).to(gl.float32), float("-inf")))
            pT = gl.where(mT, gl.convert_layout(gl.permute(qk, (1, 0)), A_L) * gamT, 0.0)
            a_pT = gl.convert_layout(pT, gl.DotOperandLayout(operand_index=0, parent=DV_L, k_width=1))
            dvl = warpgroup_mma(a_pT, doT_s.permute((1, 0)), gl.zeros([BT, V], gl.float32, DV_L), is_async=True)

        ro = gl.arange(0, BT, layout=gl.SliceLayout(1, D_L))
        col = gl.arange(0, K, layout=gl.SliceLayout(0, D_L))
        offs = ((bos + ro).to(gl.int64) * H + hh)[:, None] * K + col[None, :]
        o_ok = (bos + ro < eos)[:, None]
        # lint: allow TP001 -- [64, K] rows from the accumulator layout; a varlen tail's rows masked
        gl.store(dql_ptr + offs, dql, mask=o_ok)
        # lint: allow TP001 -- as dql
        gl.store(dkl_ptr + offs, dkl, mask=o_ok)
        if DV_LOCAL:
            dvl, _p, _o = warpgroup_mma_wait(0, deps=[dvl, a_pT, doT_s])
            rv = gl.arange(0, BT, layout=gl.SliceLayout(1, DV_L))
            vcol = gl.arange(0, V, layout=gl.SliceLayout(0, DV_L))
            # lint: allow TP001 -- as dql
            gl.store(dvl_ptr + ((bos + rv).to(gl.int64) * H + hh)[:, None] * V + vcol[None, :], dvl * scale,
                     mask=(bos + rv < eos)[:, None])
        mbarrier.invalidate(bar)


@functools.lru_cache(maxsize=None)
def _smem_layout_cached(block: tuple[int, ...], dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[dtype])


def _smem_layout(block, dtype):
    """The NVMMA shared layout of a TMA block, built once per (block, dtype): building one costs
    ~15 us of host time (H200 host profile at 4d9f371: four per forward, in a call whose host
    time, 0.67 ms, had caught up with its 0.68 ms of GPU time)."""
    return _smem_layout_cached(tuple(block), dtype)


def _descriptor(t2d: torch.Tensor, block: list[int]):
    return TensorDescriptor.from_tensor(t2d, block, _smem_layout(block, t2d.dtype))


# Which output kernel the "gluon" backend launches: "one-shot" (`_output_kernel`, one chunk and
# head per program: passed the H200 gate at 909a64e) or "persistent" (`_output_persistent_kernel`:
# the next item's loads under this one's WGMMAs; not yet run on the H200). Read at each call, so
# scripts/gdn_ab.py can time both.
OUTPUT_FORM = "one-shot"
SMEM_PER_SM = 227 * 1024  # Hopper: shared memory a CTA may use, per SM


def chunk_tile_descriptors(q, k, vn, h, plan) -> tuple:
    """The TMA descriptors of stage 6's four chunk tiles (`_issue_chunk_tiles`): q, k [Ntok, H, K]
    and Vn [Ntok, H, V] as [Ntok, H * D] with [64, D] blocks, h [NC, H, K, V] as [NC * H * K, V]
    with [K, V] blocks (all bf16). GDN's and KDA's output kernels take them."""
    Ntok, H, K = q.shape
    V = vn.shape[-1]
    return (_descriptor(q.view(Ntok, H * K), [BT, K]), _descriptor(k.view(Ntok, H * K), [BT, K]),
            _descriptor(vn.view(Ntok, H * V), [BT, V]), _descriptor(h.view(plan.NC * H * K, V), [K, V]))


def chunk_output_gluon(q, k, G, h, vn, scale: float, plan, out_dtype: torch.dtype, l2norm_q: bool):
    """6 on a Gluon kernel: o [Ntok, H, V] from q, k [Ntok, H, K] (q raw when l2norm_q), h [NC, H,
    K, V] and Vn [Ntok, H, V] in bf16."""
    from tileport.ops.gdn.triton_kernels import L2NORM_EPS, _checked, _sm_count

    Ntok, H, K = q.shape
    V = vn.shape[-1]
    o = new_empty((Ntok, H, V), out_dtype, q.device)
    if plan.NC:
        descs = chunk_tile_descriptors(q, k, vn, h, plan)
        if _checked("OUTPUT_FORM", OUTPUT_FORM, ("one-shot", "persistent")) == "persistent":
            n_items = plan.NC * H
            smem = 2 * 2 * (2 * BT * K + BT * V + K * V)  # two buffer sets of bf16 tiles
            programs = min(n_items, _sm_count(q.device) * max(1, SMEM_PER_SM // smem))
            _output_persistent_kernel[(programs,)](*descs, G, o, plan.chunks, H, n_items, float(scale), L2NORM_EPS,
                                                   K, V, l2norm_q, num_warps=4)
        else:
            _output_kernel[(plan.NC, H)](*descs, G, o, plan.chunks, H, float(scale), L2NORM_EPS, K, V, l2norm_q,
                                         num_warps=4)
    return o


# Which forward the "gluon" backend runs: "split" (Triton stages 1-5, then the output kernel of
# OUTPUT_FORM), "fused" (Triton stages 1-3 in the fused forward's forms, then
# `_states_output_kernel`: the recurrence and the output in one Gluon kernel), or "auto": fused
# where Triton's STATES_FORM rule fuses (enough (sequence, head) pairs to fill the card), and
# Triton's whole forward otherwise. H200 at 470f621 (scripts/gdn_ab.py, whole forward): S1 fused
# (BV 128, 8 warps) 0.690 ms against Triton's 0.818; B=1 T=32768 (16 pairs) Triton's split
# forward 1.577 against gluon split 1.665 (its output kernel is the slower stage 6 there) and
# fused 2.385-3.088 (16-64 programs on 132 SMs).
FORWARD_FORMS = ("split", "fused", "auto")
FORWARD_FORM = "auto"


def forward_form(pairs: int) -> str:
    """"fused", "split" or "triton" (Triton's own forward) for a forward over `pairs` (sequence,
    head) pairs (FORWARD_FORM)."""
    from tileport.ops.gdn.triton_kernels import _checked, states_form

    form = _checked("FORWARD_FORM", FORWARD_FORM, FORWARD_FORMS)
    if form == "auto":
        return "fused" if states_form(pairs) == "fused" else "triton"
    return form


# The fused kernel's V columns per program and warps: BV = 64 on one warpgroup (256 programs at
# S1, N * H * V / 64; 152 KB of shared memory at K = 128, so one CTA per SM and two waves), or
# BV = 128 on two warpgroups side by side (128 programs, one wave; the chunk's scaled keys, q's
# norms and the gates formed once for all V). Read at each call, so scripts/gdn_ab.py can time
# both. H200 at 470f621, S1, the kernel alone: 0.636 ms at (64, 4), 0.385 at (128, 8), 1.086 at
# (32, 4); Triton's fused states + output 0.514.
RECURRENCE_BV = 128
RECURRENCE_WARPS = 8
# The fused kernel's GATES: "late", "early" or "staged". H200 at c9aa543 (scripts/gdn_ab.py, whole
# forward at S1, same inputs): late 0.685 ms, early 0.677, staged 0.654; ncu at early: long-scoreboard
# stalls lead (1.74 per issued instruction), which staging the gates a chunk ahead shortens.
RECURRENCE_GATES = "staged"
# The fused kernel's RING (TMA buffer sets): 2, or 1 so that two BV = 64, 4-warp programs fit on
# an SM (RECURRENCE_BV 64, RECURRENCE_WARPS 4, RECURRENCE_RING 1: ~97 KB of shared memory each;
# sm_90a: 156-180 B of spills per thread at K = 128 against 64 with two buffer sets). H200,
# gdn_ab.py at 646b62f, whole forward at S1: (64, 4) ring 2 0.843 ms, ring 1 0.678 (0.641 with the
# TMA store), against (128, 8) ring 2 0.587: ring 2 at (128, 8) stays.
RECURRENCE_RING = 2
# The fused kernel's O_STORE: "masked" or "tma" (full chunks through shared memory and a TMA store;
# 16 KB more shared memory at BV 128). H200, gdn_ab.py at 646b62f, whole forward at S1 (BV 128,
# 8 warps, staged gates): masked 0.653 ms, tma 0.587, the same o; racecheck clean. "tma" since.
RECURRENCE_O_STORE = "tma"


GATE_FORMS = ("late", "early", "staged")


def check_recurrence_launch(V: int) -> int:
    """The fused kernel's BV for head dim V (RECURRENCE_BV, RECURRENCE_WARPS), or a ValueError
    naming the switch it cannot take."""
    from tileport.ops.gdn.triton_kernels import _checked

    _checked("RECURRENCE_GATES", RECURRENCE_GATES, GATE_FORMS)
    _checked("RECURRENCE_RING", RECURRENCE_RING, (1, 2))
    _checked("RECURRENCE_O_STORE", RECURRENCE_O_STORE, ("masked", "tma"))
    return recurrence_block(V, RECURRENCE_BV, RECURRENCE_WARPS)


def recurrence_block(V: int, bv: int, warps: int) -> int:
    """BV = min(V, bv) for a fused states + output kernel on `warps` warps (GDN's and KDA's, whose
    switches RECURRENCE_BV and RECURRENCE_WARPS these are), or a ValueError naming the switch."""
    BV = min(V, bv)
    if warps not in (4, 8):
        raise ValueError(f"RECURRENCE_WARPS {warps}: the fused kernel runs on 4 or 8 warps")
    if BV < 16 or BV & (BV - 1) or V % BV or (BV // (warps // 4)) % 8:
        raise ValueError(f"RECURRENCE_BV {bv} (BV {BV} at V={V}, {warps} warps): a power of two "
                         f">= 16 dividing V, at least 8 columns per warpgroup")
    return BV


def chunk_states_output_gluon(q, k, w, u, G, h0, plan, output_final_state: bool, scale: float,
                              out_dtype: torch.dtype, l2norm_q: bool):
    """5 and 6 on one Gluon kernel: (o [Ntok, H, V] in out_dtype, final state [N, H, K, V] fp32 or
    None) from q (raw when l2norm_q), normalised k, and W, U in bf16 (stage 3's compact form)."""
    from tileport.ops.gdn.triton_kernels import L2NORM_EPS

    Ntok, H, K = q.shape
    V = u.shape[-1]
    BV = check_recurrence_launch(V)
    o = new_empty((Ntok, H, V), out_dtype, q.device)
    ht = new_empty((plan.N, H, K, V), torch.float32, q.device) if output_final_state else None
    if plan.N:
        descs = (_descriptor(q.view(Ntok, H * K), [BT, K]), _descriptor(k.view(Ntok, H * K), [BT, K]),
                 _descriptor(w.view(Ntok, H * K), [BT, K]), _descriptor(u.view(Ntok, H * V), [BT, BV]))
        # o's descriptor only where the kernel stores through it (U's, the same block and dtype,
        # stands in otherwise: no host time for an unused one)
        descs += (_descriptor(o.view(Ntok, H * V), [BT, BV]) if RECURRENCE_O_STORE == "tma" else descs[3],)
        h0 = h0.float().contiguous() if h0 is not None else None
        _states_output_kernel[(plan.N * H, V // BV)](*descs, G, h0 if h0 is not None else o, ht if ht is not None else o,
                                                     o, plan.cu, H, float(scale), L2NORM_EPS, K, V, BV,
                                                     h0 is not None, output_final_state, l2norm_q,
                                                     RECURRENCE_GATES, RECURRENCE_RING, RECURRENCE_O_STORE,
                                                     num_warps=RECURRENCE_WARPS)
    return o, ht


def gdn_forward_gluon(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    """Triton stages 1-5 and the Gluon output kernel ("split"), Triton stages 1-3 and the fused
    Gluon recurrence + output ("fused"), or Triton's forward where "auto" finds too few (sequence,
    head) pairs for the fused kernel: FORWARD_FORM."""
    from tileport.ops.gdn import triton_kernels as tk

    B, T, H, K = q.shape
    V = v.shape[-1]
    # the form first: the plan of a varlen call reads cu_seqlens back from the GPU, which Triton's
    # forward would do again
    form = forward_form((B if cu_seqlens is None else cu_seqlens.numel() - 1) * H)
    if form == "triton":
        return tk.gdn_forward_triton(q, k, v, g, beta, scale, initial_state, output_final_state,
                                     use_qk_l2norm_in_kernel, cu_seqlens)
    plan = tk.make_plan(B, T, cu_seqlens, q.device)
    qf, kf, vf, gf, bf = (tk._flatten(x) for x in (q, k, v, g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    if form == "fused":
        tk._check_forward_switches()
        check_recurrence_launch(V)  # before stages 1-3 are launched
        kn, G, w, u, _ = tk.fused_forward_stages_1_to_3(kf, vf, gf, bf, plan, use_qk_l2norm_in_kernel,
                                                        keys_in_kernel_ok=False)
        o, ht = chunk_states_output_gluon(qf, kn, w, u, G, h0, plan, output_final_state, scale, q.dtype,
                                          use_qk_l2norm_in_kernel)
        return o.view(B, T, H, V), ht
    q_raw, kn, G, _Ai, _w, _u, h, vn, ht = tk._recompute(qf, kf, vf, gf, bf, h0, use_qk_l2norm_in_kernel, plan,
                                                         output_final_state, for_backward=False)
    o = chunk_output_gluon(q_raw, kn, G, h, vn, scale, plan, q.dtype, use_qk_l2norm_in_kernel)
    return o.view(B, T, H, V), ht


# Which kernels run the backward's two state recurrences in the "gluon" backend (the recompute's
# stage 5, BACKWARD_STATES, and stage 8, BACKWARD_DSTATES): "gluon" (`_tf32_recurrence_kernel`,
# wherever the products are tf32 on fp32 operands, BACKWARD_PRODUCTS's default for 16-bit inputs)
# or "triton" (`triton_kernels._states_kernel` / `_dstates_kernel`, which also take every other
# form). TF32_RECURRENCE_BV, TF32_RECURRENCE_WARPS: the Gluon kernel's launch (BV columns of the
# state per program, on one warpgroup per 64 of them). Read at each call, so scripts/gdn_ab.py can
# time each. H200 (gdn_ab.py "dstates", same inputs), at (128, 8) against (64, 4) and Triton's:
#   stage 8, 5117b1b and a8d219f: S1 (128 (sequence, head) pairs) 0.674 / 0.958 against 1.517 ms;
#     varlen (5 sequences of 0-4900 tokens, 80 pairs) 0.666 / 0.477 against 0.848;
#   stage 5, a8d219f: S1 0.526 / 0.584 against 0.633; varlen 0.494 / 0.571 against 0.360 (the
#     Triton kernel, autotuned to smaller V blocks, runs more programs on a short chain);
#   the whole backward at S1: 9.181 (Triton) -> 8.348 (Gluon stage 8) -> 8.214 (both).
# So BACKWARD_STATES "auto": Gluon from TF32_STATES_MIN_PAIRS (sequence, head) pairs, Triton's
# below (a threshold between the two measured points, as the forward's FUSED_STATES_MIN_PAIRS).
BACKWARD_STATES = "auto"
BACKWARD_DSTATES = "gluon"
TF32_STATES_MIN_PAIRS = 128
TF32_RECURRENCE_BV = 128
TF32_RECURRENCE_WARPS = 8
# Whether the Gluon kernel takes KDA's stage 8 on bf16 q and k (`_tf32_recurrence_kernel` A_LOADS:
# K by pointer loads, widened and gated in registers, no TMA), as KDA's BACKWARD_NORMALISED_QK
# "input" hands them (row 37 of docs/perf/kda.md: with Triton's stage 8 there, 0.84 -> 1.56 ms, the
# cut lost). On since the H200 timed it (kda_ab "normalised-qk" at a876bf4, S1): with it, the bf16
# keys cut the backward 5.059 -> 4.874 ms; without it (Triton's stage 8) 5.056 -> 5.629. It takes
# KDA's raw 16-bit q and k (no l2norm) as well; off, both take Triton's kernel.
DSTATES_16BIT_KEYS = True
_KERNEL_CHOICES = ("gluon", "triton")


def _gluon_takes(stage: str, operands, G, input_dtype, per_channel: bool = False) -> bool:
    """Whether the Gluon tf32 kernels take backward stage `stage` on these operands: its products
    tf32 (BACKWARD_PRODUCTS, per stage), every operand fp32, per-head gates (GDN's; per-channel
    ones (KDA's) where the kernel has a PER_CHANNEL form, `per_channel`), on the GPU. Stage 8 with
    per-channel gates also takes KDA's W (operands[2]) in bf16 (BACKWARD_W_DTYPE), widened on load."""
    from tileport.ops.gdn import triton_kernels as tk

    tf32 = tk._products(input_dtype, True, stage)[2].removesuffix("-emulated") == "tf32"  # (the interpreter's name)
    gates = G.dim() == 2 or per_channel and G.dim() == 3
    w16 = stage == "dstates" and per_channel and G.dim() == 3 and operands[2].dtype == torch.bfloat16
    fp32 = all(x.dtype == torch.float32 for i, x in enumerate(operands) if not (w16 and i == 2))
    # stage 8 with per-channel gates also takes bf16 q and k where DSTATES_16BIT_KEYS says so (the
    # kernel's A_LOADS), W in fp32 or bf16
    bf16_keys = (tk._checked("DSTATES_16BIT_KEYS", DSTATES_16BIT_KEYS, (False, True)) and stage == "dstates"
                 and per_channel and G.dim() == 3 and operands[0].dtype == torch.bfloat16
                 and operands[1].dtype == torch.bfloat16 and operands[2].dtype in (torch.float32, torch.bfloat16))
    return tf32 and (fp32 or bf16_keys) and gates and G.is_cuda


def recurrence_kernel_for(stage: str, operands, G, input_dtype, pairs: int = 0) -> str:
    """"gluon" or "triton": which kernel runs the backward's recurrence `stage` ("states", the
    recompute's stage 5, or "dstates", stage 8) on these operands over `pairs` (sequence, head)
    pairs (BACKWARD_STATES, BACKWARD_DSTATES)."""
    from tileport.ops.gdn import triton_kernels as tk

    name = {"states": "BACKWARD_STATES", "dstates": "BACKWARD_DSTATES"}[stage]
    choice = tk._checked(name, globals()[name], _KERNEL_CHOICES + (("auto",) if stage == "states" else ()))
    if choice == "triton" or choice == "auto" and pairs < TF32_STATES_MIN_PAIRS:
        return "triton"
    return "gluon" if _gluon_takes(stage, operands, G, input_dtype, per_channel=True) else "triton"


def check_tf32_recurrence_launch(V: int) -> int:
    """The Gluon recurrence kernel's BV for head dim V (TF32_RECURRENCE_BV, TF32_RECURRENCE_WARPS),
    or a ValueError naming them."""
    BV = min(V, TF32_RECURRENCE_BV)
    warps = TF32_RECURRENCE_WARPS
    if warps not in (4, 8) or BV not in (64, 128) or V % BV or BV // (warps // 4) < 32:
        raise ValueError(f"TF32_RECURRENCE_BV {TF32_RECURRENCE_BV}, TF32_RECURRENCE_WARPS {warps} at V={V}: BV of 64 "
                         f"or 128 dividing V on 4 or 8 warps, at least 32 columns per warpgroup")
    return BV


def _launch_tf32_recurrence(a, x1, x2, y2, add, G, s0, s, out, sfin, plan, scale: float, backward: bool):
    Ntok, H, K = a.shape
    V = add.shape[-1]
    BV = check_tf32_recurrence_launch(V)
    if plan.N:
        # 16-bit K (stage 8 of KDA's backward with BACKWARD_NORMALISED_QK "input"): loaded, not by TMA
        a_loads = a.dtype != torch.float32
        a_desc = None if a_loads else _descriptor(a.view(Ntok, H * K), [BT, K])
        _tf32_recurrence_kernel[(plan.N * H, V // BV)](
            a_desc, x1, x2 if x2 is not None else x1, y2 if y2 is not None else add, add, G,
            s0 if s0 is not None else s, s, out, sfin if sfin is not None else s, plan.cu, plan.chunk_offsets, H,
            float(scale), K, V, BV, s0 is not None, sfin is not None, backward, G.dim() == 3,
            a_ptr=a if a_loads else None, A_LOADS=a_loads, num_warps=TF32_RECURRENCE_WARPS)


def chunk_states_recompute_gluon(k, w, u, G, h0, plan, output_final_state: bool, input_dtype=None,
                                 for_backward: bool = True, **kwargs):
    """The backward's recompute of stage 5 on the Gluon kernel where `recurrence_kernel_for` says
    so, else Triton's `chunk_states`: (h [NC, H, K, V], Vn [Ntok, H, V], final state or None), fp32;
    `triton_kernels.chunk_states`'s contract for its split form."""
    from tileport.ops.gdn import triton_kernels as tk

    input_dtype = input_dtype or k.dtype
    if kwargs or not for_backward or recurrence_kernel_for("states", (k, w, u), G, input_dtype,
                                                           plan.N * k.shape[1]) == "triton":
        return tk.chunk_states(k, w, u, G, h0, plan, output_final_state, input_dtype=input_dtype,
                               for_backward=for_backward, **kwargs)
    Ntok, H, K = k.shape
    V = u.shape[-1]
    h = new_empty((plan.NC, H, K, V), torch.float32, k.device)
    vn = new_empty((Ntok, H, V), torch.float32, k.device)
    ht = new_empty((plan.N, H, K, V), torch.float32, k.device) if output_final_state else None
    _launch_tf32_recurrence(w, k, None, None, u, G, h0, h, vn, ht, plan, 1.0, backward=False)
    return h, vn, ht


def chunk_dstates_gluon(q, k, w, G, do, dvl, dht, scale: float, plan, want_dh0: bool,
                        input_dtype: torch.dtype | None = None, states_dtype: torch.dtype = torch.float32):
    """8 on the Gluon kernel where `recurrence_kernel_for` says so, else Triton's: (dh [NC, H, K, V],
    dVn [Ntok, H, V], d initial_state [N, H, K, V] or None), fp32, dh and dVn in states_dtype (fp32
    or bf16: the kernel stores its fp32 values rounded); the same contract as
    `triton_kernels.chunk_dstates`."""
    from tileport.ops.gdn import triton_kernels as tk

    input_dtype = input_dtype or q.dtype
    tk.check_states_dtype(states_dtype)
    if recurrence_kernel_for("dstates", (q, k, w), G, input_dtype) == "triton":
        return tk.chunk_dstates(q, k, w, G, do, dvl, dht, scale, plan, want_dh0, input_dtype=input_dtype,
                                states_dtype=states_dtype)
    Ntok, H, K = q.shape
    V = do.shape[-1]
    dh = new_empty((plan.NC, H, K, V), states_dtype, q.device)
    dvn = new_empty((Ntok, H, V), states_dtype, q.device)
    dh0 = new_empty((plan.N, H, K, V), torch.float32, q.device) if want_dh0 else None
    _launch_tf32_recurrence(k, w, q, do, dvl, G, dht, dh, dvn, dh0, plan, scale, backward=True)
    return dh, dvn, dh0


# Which kernel runs stage 9's state part in the "gluon" backend: "triton" (`_dqkwg_kernel` in
# Triton's DQKWG_FORM) or "gluon" (Triton's `_dqk_local_kernel`, then `_dqkwg_state_kernel`: TMA
# tiles, three tf32 WGMMAs; where the products are tf32 on fp32 operands and K is 64 or 128).
# H200 at S1 (gdn_ab.py "dqkwg", d0ddc54): Triton's 9b 1.798 ms, Gluon's per-block ~1.34, loop
# ~1.16; the whole backward 8.143 -> 7.702 ms, racecheck clean (docs/perf/gdn.md, gluon row 11).
BACKWARD_DQKWG = "gluon"
DQKWG_STATE_KEY_BLOCK = 64  # sm_90a at K = V = 128: 176 KB of shared memory (32: 147 KB; 128: 245 KB, too much)
# How `_dqkwg_state_kernel` covers the key blocks: "per-block" (one 4-warp program each, KB_LOOP
# False: 176 KB, 168 registers at K = 128) or "loop" (one 8-warp program per chunk and head over
# the blocks, KB_LOOP True: 216 KB, 246 registers; on 4 warps it spills; at most two key blocks).
DQKWG_STATE_FORMS = ("per-block", "loop")
DQKWG_STATE_FORM = "loop"
# Which kernel runs stage 9's chunk-local part (9a) where 9b runs on `_dqkwg_state_kernel`:
# "triton" (`_dqk_local_kernel`) or "gluon" (`_dqk_local_tf32_kernel`). H200 at S1 (gdn_ab.py
# "dqk", 9a1008f): 9a 1.03 -> ~0.61 ms, outputs bitwise equal to Triton's; the whole backward
# 6.133 -> 5.725 ms; racecheck clean (docs/perf/gdn.md, gluon row 13).
DQK_LOCAL = "gluon"


def dqkwg_kernel_for(operands, G, input_dtype) -> str:
    """"gluon" or "triton": which kernel runs stage 9's state part on these operands (BACKWARD_DQKWG)."""
    from tileport.ops.gdn import triton_kernels as tk

    tk._checked("DQKWG_STATE_FORM", DQKWG_STATE_FORM, DQKWG_STATE_FORMS)
    tk._checked("DQK_LOCAL", DQK_LOCAL, _KERNEL_CHOICES)
    tk._checked("DQK_LOCAL_AT", DQK_LOCAL_AT, _DQK_LOCAL_PLACES)
    if tk._checked("BACKWARD_DQKWG", BACKWARD_DQKWG, _KERNEL_CHOICES) == "triton":
        return "triton"
    return "gluon" if _gluon_takes("dqkwg", operands, G, input_dtype) else "triton"


def _launch_dqk_local(q, k, vn, do, G, dql, dkl, dG9a, dvl, plan, scale: float):
    """One launch of `_dqk_local_tf32_kernel`: 9a, and stage 7 as well where dvl is given."""
    Ntok, H, K = q.shape
    V = vn.shape[-1]
    _dqk_local_tf32_kernel[(plan.NC, H)](
        _descriptor(q.view(Ntok, H * K), [BT, K]), _descriptor(k.view(Ntok, H * K), [BT, K]),
        _descriptor(vn.view(Ntok, H * V), [BT, V]), do, G, dql, dkl, dG9a, dvl if dvl is not None else dql,
        plan.chunks, H, float(scale), K, V, dvl is not None, num_warps=8)


# Where the gluon backend runs 9a when DQK_LOCAL is "gluon": "stage-9" (before 9b, in
# `chunk_dqkwg_gluon`) or "stage-7" (with stage 7's dVl in one launch, `chunk_dv_local_gluon`:
# Q K^T and dO loaded and formed once for both, Triton's `_dv_local_kernel` (0.48 ms at S1) gone;
# dql, dkl and 9a's partial of dG wait through stage 8 for 9b). H200 at S1 (gdn_ab.py "dqk" at
# dcbb92d): the whole backward 5.736 -> 5.553 ms, gradients bitwise equal; racecheck clean
# (docs/perf/gdn.md, gluon row 14).
DQK_LOCAL_AT = "stage-7"
_DQK_LOCAL_PLACES = ("stage-9", "stage-7")


def chunk_dv_local_gluon(q, k, G, do, scale: float, plan, input_dtype=None, vn=None, held=None):
    """Stage 7 (`triton_kernels.chunk_dv_local`'s contract: dVl [Ntok, H, V] fp32), with 9a in the
    same launch where DQK_LOCAL_AT is "stage-7" and the Gluon kernel takes the call; 9a's results
    (dql, dkl, its partial of dG) go into `held` for `chunk_dqkwg_gluon`."""
    from tileport.ops.gdn import triton_kernels as tk

    input_dtype = input_dtype or q.dtype
    fused = (tk._checked("DQK_LOCAL_AT", DQK_LOCAL_AT, _DQK_LOCAL_PLACES) == "stage-7" and held is not None
             and vn is not None and q.shape[-1] == vn.shape[-1] == do.shape[-1]
             and dqkwg_kernel_for((q, k, vn), G, input_dtype) == "gluon" and DQK_LOCAL == "gluon"
             and _gluon_takes("dv_local", (q, k), G, input_dtype))
    if not fused:
        return tk.chunk_dv_local(q, k, G, do, scale, plan, input_dtype=input_dtype)
    Ntok, H, K = q.shape
    dvl = new_empty((Ntok, H, do.shape[-1]), torch.float32, q.device)
    dql, dkl, dG9a = (new_empty((Ntok, H, K), torch.float32, q.device), new_empty((Ntok, H, K), torch.float32, q.device),
                      new_empty((Ntok, H), torch.float32, q.device))
    if plan.NC:
        _launch_dqk_local(q, k, vn, do, G, dql, dkl, dG9a, dvl, plan, scale)
    held["local"] = (dql, dkl, dG9a)
    return dvl


def chunk_dqkwg_gluon(q, k, G, h, dh, vn, dvn, do, scale: float, plan, dq_dtype: torch.dtype,
                      input_dtype: torch.dtype | None = None, held=None):
    """9 with its state part on the Gluon kernel where `dqkwg_kernel_for` says so (the chunk-local
    part on Triton's `_dqk_local_kernel`, or on `_dqk_local_tf32_kernel` where DQK_LOCAL says so),
    else Triton's `chunk_dqkwg`; the same contract. The
    Gluon path is always the split form whatever DQKWG_FORM says (dG's partials: K /
    DQKWG_STATE_KEY_BLOCK from the state part, the last from 9a)."""
    from tileport.ops.gdn import triton_kernels as tk

    input_dtype = input_dtype or q.dtype
    local = (held or {}).pop("local", None)  # 9a's results, where stage 7 formed them
    if dqkwg_kernel_for((q, k, h, dh, vn, dvn), G, input_dtype) == "triton":
        if local is not None:
            raise RuntimeError("stage 9a ran with stage 7 on the Gluon kernel, but stage 9 is Triton's for this call")
        return tk.chunk_dqkwg(q, k, G, h, dh, vn, dvn, do, scale, plan, dq_dtype, input_dtype=input_dtype)
    Ntok, H, K = q.shape
    V = do.shape[-1]
    # its own block of key columns (not DQKWG_KEY_BLOCK, which may be 128: 245 KB of shared memory
    # here); stage 10 reads however many partials of dG there are
    BKS = min(K, DQKWG_STATE_KEY_BLOCK)
    NK = K // BKS
    dq = tk._out((Ntok, H, K), dq_dtype, q.device)
    dk = new_empty((Ntok, H, K), torch.float32, q.device)
    dw = new_empty((Ntok, H, K), torch.float32, q.device)
    dG = new_empty((NK + 1, Ntok, H), torch.float32, q.device)
    if plan.NC:
        BK, BV, NV = tk._blocks(K, V)
        products = tk._products(input_dtype, True, "dqkwg")
        if local is not None:  # 9a ran with stage 7 (`chunk_dv_local_gluon`)
            dql, dkl, dG[NK] = local
        elif DQK_LOCAL == "gluon":  # (checked by dqkwg_kernel_for)
            dql, dkl = (new_empty((Ntok, H, K), torch.float32, q.device) for _ in range(2))
            _launch_dqk_local(q, k, vn, do, G, dql, dkl, dG[NK], None, plan, scale)
        else:
            dql, dkl = (new_empty((Ntok, H, K), torch.float32, q.device) for _ in range(2))
            tk._dqk_local_kernel[(plan.NC, H)](q, k, G, vn, do, dql, dkl, dG[NK], plan.chunks, H, scale, K, V, BKS, BV,
                                               NV, BT, *products, **tk._LAUNCH["dqkwg"])
        descs = (_descriptor(h.view(plan.NC * H * K, V), [BKS, V]), _descriptor(dh.view(plan.NC * H * K, V), [BKS, V]),
                 _descriptor(vn.view(Ntok, H * V), [BT, V]), _descriptor(dvn.view(Ntok, H * V), [BT, V]),
                 _descriptor(do.view(Ntok, H * V), [BT, V]))
        loop = DQKWG_STATE_FORM == "loop"  # (checked by dqkwg_kernel_for)
        if loop and NK > 2:
            raise ValueError(f"DQKWG_STATE_FORM 'loop' holds at most two key blocks: K={K} at DQKWG_STATE_KEY_BLOCK "
                             f"{DQKWG_STATE_KEY_BLOCK} gives {NK}")
        _dqkwg_state_kernel[(plan.NC * (1 if loop else NK), H)](*descs, q, k, G, dql, dkl, dq, dk, dw, dG, plan.chunks, H,
                                                                float(scale), Ntok * H, K, V, BKS, loop,
                                                                num_warps=8 if loop else 4)
    return tk._done(dq, dq_dtype), dk, dw, dG



# Which kernel runs stage 10 (back through W, U, T and A) in the "gluon" backend: "triton"
# (`chunk_wy_bwd` in Triton's WY_BWD_FORM) or "gluon" (`_wy_bwd_tf32_kernel`, where the products
# are tf32 on fp32 operands and K = V is 64 or 128). H200 at S1 (gdn_ab.py "wy", b39a43f): Triton's
# split form 2.540 ms, Gluon's 1.157; the whole backward 7.567 -> 6.182 ms; racecheck clean
# (docs/perf/gdn.md, gluon row 12).
BACKWARD_WY = "gluon"
# Where the gluon backend's stage 10 takes dK back through the keys' l2 normalisation
# (use_qk_l2norm_in_kernel): "apart" (Triton's `l2norm_bwd` after it: dK stored in fp32 and read
# back, one more launch, ~0.12 ms at S1 under ncu) or "fused" (in `_wy_bwd_tf32_kernel`'s epilogue,
# L2NORM_K). H200 at S1 (gdn_ab.py "wy" at dcbb92d): the whole backward 5.729 -> 5.700 ms;
# racecheck clean (docs/perf/gdn.md, gluon row 15).
WY_L2NORM_K = "fused"
_WY_L2NORM_FORMS = ("apart", "fused")
# The tiles stage 10's Gluon kernel holds: "whole" (`_wy_bwd_tf32_kernel`, [64, K] fp32 tiles,
# 176 KB of shared memory at K = 128 on 8 warps: one program per SM) or "halves"
# (`_wy_bwd_halves_kernel`, [64, 64] tiles, ~100 KB on 4 warps: two programs per SM, K and dW read
# twice). The ncu profile has the whole-width kernel at 12.4% occupancy and 52% of memory
# throughput (9c790a4): a second program per SM should fill the gaps. It did not: H200 at S1
# (gdn_ab.py "wy" at dcbb92d) 1.174 ms against the whole-width kernel's 1.152 (sm_90a: 255
# registers and 304 B of spills per thread at K = 128; docs/perf/gdn.md, gluon row 16). Off; no
# gate form. ("halves" takes k's l2norm backward apart whatever WY_L2NORM_K says: its dK
# rows are never whole in one program.)
WY_TILES = "whole"
_WY_TILE_FORMS = ("whole", "halves")


def wy_bwd_kernel_for(operands, G, input_dtype) -> str:
    """"gluon" or "triton": which kernel runs stage 10 on these operands (BACKWARD_WY)."""
    from tileport.ops.gdn import triton_kernels as tk

    tk._checked("WY_L2NORM_K", WY_L2NORM_K, _WY_L2NORM_FORMS)
    tk._checked("WY_TILES", WY_TILES, _WY_TILE_FORMS)
    if tk._checked("BACKWARD_WY", BACKWARD_WY, _KERNEL_CHOICES) == "triton":
        return "triton"
    K, V = operands[0].shape[-1], operands[2].shape[-1]
    return "gluon" if K == V and K in HEAD_DIMS and _gluon_takes("wy_bwd", operands, G, input_dtype) else "triton"


def chunk_wy_bwd_gluon(k, v, beta, G, Ai, w, u, dw, dvn, dkp, dGp, plan, dk_dtype: torch.dtype,
                       dv_dtype: torch.dtype, dbeta_dtype: torch.dtype, dg_dtype: torch.dtype,
                       input_dtype: torch.dtype | None = None, raw_k=None):
    """Stage 10 on `_wy_bwd_tf32_kernel` where `wy_bwd_kernel_for` says so, else Triton's
    `chunk_wy_bwd` (whose contract this is): dk, dv, dbeta, dg in the dtypes asked for; with raw_k
    (k is its l2 normalisation) dk is the raw keys' gradient, the normalisation's backward in the
    same kernel where WY_L2NORM_K is "fused"."""
    from tileport.ops.gdn import triton_kernels as tk

    input_dtype = input_dtype or k.dtype
    fuse_l2 = raw_k is not None and WY_L2NORM_K == "fused" and WY_TILES == "whole"  # (checked by wy_bwd_kernel_for)
    if raw_k is not None and (raw_k.shape != k.shape or not raw_k.is_contiguous()):
        raise ValueError(f"raw_k must be contiguous with k's shape {tuple(k.shape)}, got {tuple(raw_k.shape)}")
    if wy_bwd_kernel_for((k, w, u, dw, dvn, Ai, dkp), G, input_dtype) == "triton":
        return tk.chunk_wy_bwd(k, v, beta, G, Ai, w, u, dw, dvn, dkp, dGp, plan, dk_dtype, dv_dtype, dbeta_dtype,
                               dg_dtype, input_dtype=input_dtype, raw_k=raw_k)
    if raw_k is not None and not fuse_l2:  # the normalisation's backward apart, after the kernel
        dk, dv, dbeta, dg = chunk_wy_bwd_gluon(k, v, beta, G, Ai, w, u, dw, dvn, dkp, dGp, plan, torch.float32,
                                               dv_dtype, dbeta_dtype, dg_dtype, input_dtype=input_dtype)
        return tk.l2norm_bwd(raw_k, dk, dk_dtype), dv, dbeta, dg
    Ntok, H, K = k.shape
    V = v.shape[-1]
    dk = new_empty((Ntok, H, K), dk_dtype, k.device)
    dv = new_empty((Ntok, H, V), dv_dtype, k.device)
    dbeta = new_empty((Ntok, H), dbeta_dtype, k.device)
    dg = new_empty((Ntok, H), dg_dtype, k.device)
    if plan.NC and WY_TILES == "halves":
        HB = min(64, K)
        _wy_bwd_halves_kernel[(plan.NC, H)](
            _descriptor(u.view(Ntok, H * V), [BT, HB]), _descriptor(w.view(Ntok, H * K), [BT, HB]),
            _descriptor(k.view(Ntok, H * K), [BT, HB]), Ai, dw, dvn, v, beta, G, dkp, dGp, dk, dv, dbeta, dg,
            plan.chunks, H, Ntok * H, K, V, dGp.shape[0], num_warps=4)
    elif plan.NC:
        _wy_bwd_tf32_kernel[(plan.NC, H)](
            _descriptor(u.view(Ntok, H * V), [BT, V]), _descriptor(w.view(Ntok, H * K), [BT, K]),
            _descriptor(k.view(Ntok, H * K), [BT, K]), Ai, dw, dvn, v, beta, G, dkp, dGp, dk, dv, dbeta, dg,
            plan.chunks, raw_k if fuse_l2 else k, H, Ntok * H, tk.L2NORM_EPS, K, V, dGp.shape[0], fuse_l2,
            num_warps=8)  # 4 warps spill (sm_90a: 500 B at K = 128)
    return dk, dv, dbeta, dg


def gdn_backward_gluon(do, dht, q, k, v, *args):
    """Triton's backward with its two state recurrences (the recompute's stage 5 and stage 8) on
    the Gluon kernel (`chunk_states_recompute_gluon`, `chunk_dstates_gluon`) and, where
    BACKWARD_DQKWG says so, stage 9's state part (`chunk_dqkwg_gluon`), and where BACKWARD_WY says
    so, stage 10 (`chunk_wy_bwd_gluon`); its other stages' Gluon ports are the next steps of issue 5."""
    from tileport.ops.gdn.triton_kernels import gdn_backward_triton

    check_tf32_recurrence_launch(v.shape[-1])  # before the recompute is launched
    held = {}  # 9a's results from stage 7 to stage 9 (DQK_LOCAL_AT "stage-7")
    return gdn_backward_triton(do, dht, q, k, v, *args, stages=dict(
        states=chunk_states_recompute_gluon, dstates=chunk_dstates_gluon,
        dv_local=functools.partial(chunk_dv_local_gluon, held=held),
        dqkwg=functools.partial(chunk_dqkwg_gluon, held=held), wy_bwd=chunk_wy_bwd_gluon))


# --------------------------------------------------------------------------------------------
# CPU compile checks (tileport.compile_check)
# --------------------------------------------------------------------------------------------
def compile_cases():
    """Both output kernels at K = V = 128 and 64, with and without the in-kernel q normalisation."""
    if _GLUON_ERROR is not None:
        return []
    from tileport.compile_check import CompileCase, TensorStandIn, descriptor_stand_in

    cases = []
    Ntok, H, NC = 32768, 16, 512
    bf = torch.bfloat16
    for K, V, l2 in ((128, 128, True), (128, 128, False), (64, 64, True)):
        def desc(rows, cols, block):
            return descriptor_stand_in([rows, cols], bf, block, _smem_layout(block, bf))

        args = dict(q_desc=desc(Ntok, H * K, [BT, K]), k_desc=desc(Ntok, H * K, [BT, K]),
                    vn_desc=desc(Ntok, H * V, [BT, V]), h_desc=desc(NC * H * K, V, [K, V]),
                    G_ptr=TensorStandIn([Ntok, H], torch.float64), o_ptr=TensorStandIn([Ntok, H, V], bf),
                    chunks_ptr=TensorStandIn([2 * NC], torch.int64),  # int64 (wider than the GPU plan's int32): keeps the int32 cast of TMA coordinates tested
                    H=H, scale=0.1, eps=1e-6, K=K, V=V, L2NORM_Q=l2)
        tag = f"K{K}_V{V}{'_l2q' if l2 else ''}"
        expect = ["wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait"]
        cases.append(CompileCase(name=f"gdn_output_{tag}", kernel=_output_kernel, args=args,
                                 num_warps=4, expect_ptx=expect, expect_max_spills=0))
        cases.append(CompileCase(name=f"gdn_output_persistent_{tag}", kernel=_output_persistent_kernel,
                                 args=dict(args, n_items=NC * H), num_warps=4, expect_ptx=expect, expect_max_spills=0,
                                 expect_max_shared=SMEM_PER_SM))
        N = 8
        for BV, warps in ((min(V, 64), 4), (V, 8)):
            fused = dict(q_desc=desc(Ntok, H * K, [BT, K]), k_desc=desc(Ntok, H * K, [BT, K]),
                         w_desc=desc(Ntok, H * K, [BT, K]), u_desc=desc(Ntok, H * V, [BT, BV]),
                         o_desc=desc(Ntok, H * V, [BT, BV]),
                         G_ptr=TensorStandIn([Ntok, H], torch.float64), h0_ptr=TensorStandIn([N, H, K, V], torch.float32),
                         ht_ptr=TensorStandIn([N, H, K, V], torch.float32), o_ptr=TensorStandIn([Ntok, H, V], bf),
                         cu_ptr=TensorStandIn([N + 1], torch.int64), H=H, scale=0.1, eps=1e-6, K=K, V=V, BV=BV,
                         HAS_H0=True, STORE_FINAL=True, L2NORM_Q=l2)
            for gates in GATE_FORMS:
                cases.append(CompileCase(name=f"gdn_states_output_{tag}_BV{BV}_w{warps}_{gates}",
                                         kernel=_states_output_kernel,
                                         args=dict(fused, GATES=gates, RING=2, O_STORE="masked"),
                                         num_warps=warps, expect_ptx=expect,
                                         expect_max_spills=0 if gates == "late" or warps == 8 and gates == "staged" else 64,
                                         expect_max_shared=SMEM_PER_SM))
            if warps == 8:  # o through shared memory and a TMA store (cp.async.bulk.tensor both ways)
                cases.append(CompileCase(name=f"gdn_states_output_{tag}_BV{BV}_w{warps}_staged_tma_store",
                                         kernel=_states_output_kernel,
                                         args=dict(fused, GATES="staged", RING=2, O_STORE="tma"),
                                         num_warps=warps, expect_ptx=expect + ["cp.async.bulk.tensor.2d.global.shared"],
                                         expect_max_spills=0, expect_max_shared=SMEM_PER_SM))
            if warps == 4:  # one buffer set: two programs per SM (half its shared memory each)
                cases.append(CompileCase(name=f"gdn_states_output_{tag}_BV{BV}_w{warps}_staged_ring1",
                                         kernel=_states_output_kernel,
                                         args=dict(fused, GATES="staged", RING=1, O_STORE="masked"),
                                         num_warps=warps, expect_ptx=expect,
                                         expect_max_spills=200,  # sm_90a: 156-180 B at K = 128 (ring 2: 64)
                                         expect_max_shared=SMEM_PER_SM // 2))
    for K in (128, 64):  # stage 9's state part: fp32 TMA tiles (dO bf16), tf32 WGMMA
        V = K
        BKS = 64
        f32 = torch.float32

        def desc32(rows, cols, block, dtype=f32):
            return descriptor_stand_in([rows, cols], dtype, block, _smem_layout(block, dtype))

        args = dict(h_desc=desc32(NC * H * K, V, [BKS, V]), dh_desc=desc32(NC * H * K, V, [BKS, V]),
                    vn_desc=desc32(Ntok, H * V, [BT, V]), dvn_desc=desc32(Ntok, H * V, [BT, V]),
                    do_desc=desc32(Ntok, H * V, [BT, V], bf), q_ptr=TensorStandIn([Ntok, H, K], f32),
                    k_ptr=TensorStandIn([Ntok, H, K], f32), G_ptr=TensorStandIn([Ntok, H], torch.float64),
                    dql_ptr=TensorStandIn([Ntok, H, K], f32), dkl_ptr=TensorStandIn([Ntok, H, K], f32),
                    dq_ptr=TensorStandIn([Ntok, H, K], f32), dk_ptr=TensorStandIn([Ntok, H, K], f32),
                    dw_ptr=TensorStandIn([Ntok, H, K], f32), dG_ptr=TensorStandIn([3, Ntok, H], f32),
                    chunks_ptr=TensorStandIn([2 * NC], torch.int32), H=H, scale=0.1, dG_stride=Ntok * H, K=K, V=V,
                    BKS=BKS)
        for loop, warps in ((False, 4), (True, 8)):  # the loop form on 4 warps: 188 B of spills at K = 128
            cases.append(CompileCase(name=f"gdn_dqkwg_state_K{K}_V{V}{'_kb_loop' if loop else ''}_w{warps}",
                                     kernel=_dqkwg_state_kernel, args=dict(args, KB_LOOP=loop), num_warps=warps,
                                     expect_ptx=["wgmma.mma_async.sync.aligned.m64n", "k8.f32.tf32.tf32",
                                                 "cp.async.bulk.tensor", "mbarrier.try_wait"],
                                     expect_max_spills=0, expect_max_shared=SMEM_PER_SM))
    for K in (128, 64):  # stage 9a: fp32 TMA tiles (q, k, Vn), dO bf16, tf32 WGMMA, 8 warps
        V = K
        f32 = torch.float32

        def desc32(rows, cols, block):
            return descriptor_stand_in([rows, cols], f32, block, _smem_layout(block, f32))

        rows32 = TensorStandIn([Ntok, H, K], f32)
        args = dict(q_desc=desc32(Ntok, H * K, [BT, K]), k_desc=desc32(Ntok, H * K, [BT, K]),
                    vn_desc=desc32(Ntok, H * V, [BT, V]), do_ptr=TensorStandIn([Ntok, H, V], bf),
                    G_ptr=TensorStandIn([Ntok, H], torch.float64), dql_ptr=rows32, dkl_ptr=rows32,
                    dG_ptr=TensorStandIn([Ntok, H], f32), dvl_ptr=TensorStandIn([Ntok, H, V], f32),
                    chunks_ptr=TensorStandIn([2 * NC], torch.int32), H=H, scale=0.1, K=K, V=V)
        for dv_local in (False, True):  # with stage 7 (DQK_LOCAL_AT "stage-7") or without
            cases.append(CompileCase(name=f"gdn_dqk_local_K{K}_V{V}{'_dv_local' if dv_local else ''}_w8",
                                     kernel=_dqk_local_tf32_kernel, args=dict(args, DV_LOCAL=dv_local), num_warps=8,
                                     expect_ptx=["wgmma.mma_async.sync.aligned.m64n", "tf32.tf32",
                                                 "cp.async.bulk.tensor", "mbarrier.try_wait"],
                                     expect_max_spills=0, expect_max_shared=SMEM_PER_SM))
    for K in (128, 64):  # stage 10: fp32 TMA tiles (U, W, K), tf32 WGMMA, 8 warps (sm_90a: 4 spill 500 B at K = 128)
        V = K
        f32 = torch.float32

        def desc32(rows, cols, block):
            return descriptor_stand_in([rows, cols], f32, block, _smem_layout(block, f32))

        rows32 = TensorStandIn([Ntok, H, K], f32)
        args = dict(u_desc=desc32(Ntok, H * V, [BT, V]), w_desc=desc32(Ntok, H * K, [BT, K]),
                    k_desc=desc32(Ntok, H * K, [BT, K]), t_ptr=TensorStandIn([Ntok, H, BT], f32), dw_ptr=rows32,
                    dvn_ptr=TensorStandIn([Ntok, H, V], f32), v_ptr=TensorStandIn([Ntok, H, V], bf),
                    beta_ptr=TensorStandIn([Ntok, H], bf), G_ptr=TensorStandIn([Ntok, H], torch.float64),
                    dkp_ptr=rows32, dGp_ptr=TensorStandIn([3, Ntok, H], f32), dk_ptr=rows32,
                    dv_ptr=TensorStandIn([Ntok, H, V], bf), dbeta_ptr=TensorStandIn([Ntok, H], bf),
                    dg_ptr=TensorStandIn([Ntok, H], f32), chunks_ptr=TensorStandIn([2 * NC], torch.int32),
                    kraw_ptr=TensorStandIn([Ntok, H, K], bf), H=H, dGp_stride=Ntok * H, eps=1e-6, K=K, V=V, NKP=3)
        for l2 in (False, True):  # dK as it is, or through the keys' l2norm backward (WY_L2NORM_K)
            cases.append(CompileCase(name=f"gdn_wy_bwd_K{K}_V{V}{'_l2k' if l2 else ''}_w8", kernel=_wy_bwd_tf32_kernel,
                                     args=dict(args, L2NORM_K=l2, dk_ptr=TensorStandIn([Ntok, H, K], bf if l2 else f32)),
                                     num_warps=8, expect_ptx=["wgmma.mma_async.sync.aligned.m64n", "tf32.tf32",
                                                                  "cp.async.bulk.tensor", "mbarrier.try_wait"],
                                     expect_max_spills=0, expect_max_shared=SMEM_PER_SM))
    for K in (128, 64):  # stage 10 in 64-column blocks (WY_TILES "halves"): 4 warps, two programs per SM
        V = K
        f32 = torch.float32

        def desc32(rows, cols, block):
            return descriptor_stand_in([rows, cols], f32, block, _smem_layout(block, f32))

        rows32 = TensorStandIn([Ntok, H, K], f32)
        args = dict(u_desc=desc32(Ntok, H * V, [BT, 64]), w_desc=desc32(Ntok, H * K, [BT, 64]),
                    k_desc=desc32(Ntok, H * K, [BT, 64]), t_ptr=TensorStandIn([Ntok, H, BT], f32), dw_ptr=rows32,
                    dvn_ptr=TensorStandIn([Ntok, H, V], f32), v_ptr=TensorStandIn([Ntok, H, V], bf),
                    beta_ptr=TensorStandIn([Ntok, H], bf), G_ptr=TensorStandIn([Ntok, H], torch.float64),
                    dkp_ptr=rows32, dGp_ptr=TensorStandIn([3, Ntok, H], f32), dk_ptr=rows32,
                    dv_ptr=TensorStandIn([Ntok, H, V], bf), dbeta_ptr=TensorStandIn([Ntok, H], bf),
                    dg_ptr=TensorStandIn([Ntok, H], f32), chunks_ptr=TensorStandIn([2 * NC], torch.int32), H=H,
                    dGp_stride=Ntok * H, K=K, V=V, NKP=3)
        cases.append(CompileCase(name=f"gdn_wy_bwd_halves_K{K}_V{V}_w4", kernel=_wy_bwd_halves_kernel, args=args,
                                 num_warps=4, expect_ptx=["wgmma.mma_async.sync.aligned.m64n", "tf32.tf32",
                                                          "cp.async.bulk.tensor", "mbarrier.try_wait"],
                                 # sm_90a: 304 B of spills at K = 128 (116 at 64) at 255 registers; 8 warps
                                 # spill none at 236 registers, which leave one program per SM
                                 expect_max_spills=320, expect_max_shared=SMEM_PER_SM // 2))
    for K in (128, 64):  # the backward's state recurrences (stages 5 and 8): fp32 operands, tf32 WGMMA
        V = K
        N = 8
        f32 = torch.float32
        for BV, warps in ((min(V, 64), 4), (min(V, 128), 8)):  # TF32_RECURRENCE_BV 64 and 128 (V = 64: 64 on 8 warps)
            # GDN's per-head gates (fp64) and KDA's per-channel ones (PER_CHANNEL, G in fp32 as KDA's
            # backward of 16-bit inputs stores it)
            for backward, per_channel in itertools.product((False, True), (False, True)):
                adesc = descriptor_stand_in([Ntok, H * K], f32, [BT, K], _smem_layout([BT, K], f32))
                G = TensorStandIn([Ntok, H, K], f32) if per_channel else TensorStandIn([Ntok, H], torch.float64)
                args = dict(a_desc=adesc, x1_ptr=TensorStandIn([Ntok, H, K], f32),
                            x2_ptr=TensorStandIn([Ntok, H, K], f32), y2_ptr=TensorStandIn([Ntok, H, V], bf),
                            add_ptr=TensorStandIn([Ntok, H, V], f32), G_ptr=G,
                            s0_ptr=TensorStandIn([N, H, K, V], f32), s_ptr=TensorStandIn([NC, H, K, V], f32),
                            out_ptr=TensorStandIn([Ntok, H, V], f32), sfin_ptr=TensorStandIn([N, H, K, V], f32),
                            cu_ptr=TensorStandIn([N + 1], torch.int32), choff_ptr=TensorStandIn([N + 1], torch.int32),
                            H=H, scale=0.1, K=K, V=V, BV=BV, HAS_S0=True, STORE_FINAL=True, BACKWARD=backward,
                            PER_CHANNEL=per_channel)
                op = ("kda" if per_channel else "gdn") + ("_dstates" if backward else "_states_recompute")
                cases.append(CompileCase(name=f"{op}_K{K}_V{V}_BV{BV}_w{warps}",
                                         kernel=_tf32_recurrence_kernel, args=args, num_warps=warps,
                                         expect_ptx=["wgmma.mma_async.sync.aligned.m64n", "tf32.tf32",
                                                     "cp.async.bulk.tensor", "mbarrier.try_wait"],
                                         # sm_90a at K = 128 on 4 warps: GDN 8 B, KDA (per-channel gates held beside
                                         # the tiles) 48-56 B; 8 warps (the default launch) none
                                         expect_max_spills=0 if warps == 8 else 64 if per_channel else 16,
                                         expect_max_shared=SMEM_PER_SM))
                if backward and per_channel and warps == 8:
                    # KDA's stage 8 on bf16 q and k (A_LOADS: K by loads; no TMA in the kernel then)
                    bargs = dict(args, a_desc=None, a_ptr=TensorStandIn([Ntok, H, K], bf),
                                 x2_ptr=TensorStandIn([Ntok, H, K], bf), A_LOADS=True)
                    cases.append(CompileCase(name=f"{op}_bf16_keys_K{K}_V{V}_BV{BV}_w{warps}",
                                             kernel=_tf32_recurrence_kernel, args=bargs, num_warps=warps,
                                             expect_ptx=["wgmma.mma_async.sync.aligned.m64n", "tf32.tf32"],
                                             # sm_90a at K = 128: 12 B (the widened K halves beside the gates)
                                             expect_max_spills=12 if K == 128 else 0, expect_max_shared=SMEM_PER_SM))
                    # and dh, dVn stored in bf16 (KDA's BACKWARD_DSTATES_DTYPE "bf16")
                    b16args = dict(bargs, s_ptr=TensorStandIn([NC, H, K, V], bf), out_ptr=TensorStandIn([Ntok, H, V], bf))
                    cases.append(CompileCase(name=f"{op}_bf16_keys_bf16_out_K{K}_V{V}_BV{BV}_w{warps}",
                                             kernel=_tf32_recurrence_kernel, args=b16args, num_warps=warps,
                                             expect_ptx=["wgmma.mma_async.sync.aligned.m64n", "tf32.tf32",
                                                         "cvt.rn.bf16"],
                                             # sm_90a at K = 128: 20 B (8 more than the fp32 stores': the
                                             # conversions' registers)
                                             expect_max_spills=20 if K == 128 else 0, expect_max_shared=SMEM_PER_SM))
                    # and W in bf16 too (KDA's BACKWARD_W_DTYPE "bf16": X1 widened on load)
                    w16args = dict(b16args, x1_ptr=TensorStandIn([Ntok, H, K], bf))
                    cases.append(CompileCase(name=f"{op}_bf16_keys_w_bf16_out_K{K}_V{V}_BV{BV}_w{warps}",
                                             kernel=_tf32_recurrence_kernel, args=w16args, num_warps=warps,
                                             expect_ptx=["wgmma.mma_async.sync.aligned.m64n", "tf32.tf32",
                                                         "cvt.rn.bf16"],
                                             # sm_90a at K = 128: 24 B (4 more than with fp32 W)
                                             expect_max_spills=24 if K == 128 else 0, expect_max_shared=SMEM_PER_SM))
    return cases
