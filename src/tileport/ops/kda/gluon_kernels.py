"""Kimi Delta Attention, Gluon backend for Hopper (sm_90): the forward's output (stage 6) for the
chunks that take the whole-chunk form, on TMA and WGMMA.

The backend "gluon" is the Triton backend (tileport.ops.kda.triton_kernels) with stage 6's
whole-chunk launch replaced by a Gluon kernel. Stage 3 flags each chunk whose per-channel gates
span more than 60 about its middle row (DIAGONAL_FORM "chunk"); those chunks keep Triton's
16-row sub-block kernel (`triton_kernels.output_flagged_chunks`), every other chunk is one program
of `_kda_output_wgmma_kernel` here (two per SM: 96 KB of shared memory at K = V = 128). H200 at
151d1b4 (scripts/kda_ab.py "gluon", S1, logsigmoid gates): the whole forward 1.559 ms against
Triton's 1.998, the kernel ~0.34 ms per forward against ~0.78 for Triton's whole-chunk launch
(torch profiler); a persistent form with two TMA buffer sets, one program per SM, took ~0.47 (1.699
ms forward) and was removed (docs/perf/kda.md row 14). The backward is Triton's
(`kda_backward_triton`) with its two state recurrences on GDN's `_tf32_recurrence_kernel` in
its PER_CHANNEL form (docs/perf/kda.md row 17), stage 10 with 10b's pair terms for the unflagged
chunks on two kernels (BACKWARD_WY, WY_FORM "split", rows 20 and 23: `_kda_wy_dA_kernel` for dA,
dV and M, then `_kda_wy_pairs_kernel` for the pair terms, two programs of 4 warps an SM each:
2.32 -> 2.15 ms at S1; the one-kernel form, `_kda_wy_bwd_wgmma_kernel`, one latency-bound CTA of
8 warps an SM, 2.49 -> 2.31 against Triton's) and stage 9 with 9b's pair terms for the unflagged
chunks (BACKWARD_DQKWG, row 21: 2.41 -> 1.39 ms at S1) on
`_kda_dqkwg_wgmma_kernel`: TMA for h, dh, Vn, dVn, six tf32 WGMMAs on fp32 operands per chunk,
head and block of 64 key channels (dP, dQh, dKd, dW over V; R and C over the chunk's tokens),
Triton's exponents d = G - G_m and summation order (`chunk_dqkwg_kda_gluon`; the flagged chunks
on Triton's `_kda_dqkwg_kernel`, CHUNKS "flagged", into the same buffers).

Stages 5 and 6 of the forward run fused on `_kda_states_output_kernel`: h never leaves the chip;
the unflagged chunks' output is formed there as `_kda_chunk_output` forms it, the flagged chunks'
by Triton's block kernel from the h and Vn the kernel stores for them only; each chunk's gates
loaded at the end of the one before (RECURRENCE_GATES "ahead"; docs/perf/kda.md rows 25, 26). In
its default form, FORWARD_RECURRENCE "fused-t", stage 3 stops at T and the kernel forms Vn from T,
v and beta (no W and U in the forward) and normalises q itself (rows 27, 28: the forward 1.249 ->
0.970 ms at S1); "fused" reads stage 3's W and U; "split" keeps Triton's states kernel and
`_kda_output_wgmma_kernel` above.

Stage 3 of the forward has a Gluon kernel too, `_kda_solve_wgmma_kernel` (FORWARD_SOLVE, off: bitwise
equal to Triton's tile kernel but slower on the H200, 0.915 against 0.72 ms at S1; docs/perf/kda.md
row 24). Stage 7 of the backward has one, `_kda_dv_local_wgmma_kernel` (BACKWARD_DV_LOCAL, off until
the H200 has run it; row 43).

Per chunk, with d = G - G_m (m the chunk's middle row, fp32) and factors that are finite where the
chunk is not flagged (|d| <= 60):
    P = lower((Q * exp(d)) (K * exp(-d))^T)          one [64, K] x [K, 64] bf16 WGMMA
    O = scale ((Q * exp(d + G_m)) h_c + P Vn)        two more, onto one fp32 accumulator
the same operands, roundings and masks as Triton's `_kda_output_chunk`, so the two agree to the
order of the fp32 accumulation.

bf16 only, K = V of 64 or 128 (GDN's Gluon kernels' shapes): fp16 inputs take bf16 products in
Triton's kernels (gate products underflow fp16) and fp32 inputs the exact block kernels.
"""

from __future__ import annotations


import torch

from tileport.memory import new_empty
from tileport.ops.gdn.gluon_kernels import (SMEM_PER_SM, _GLUON_ERROR, _descriptor, _smem_layout,
                                            chunk_dstates_gluon, chunk_states_recompute_gluon,
                                            chunk_tile_descriptors, recurrence_block)
from tileport.ops.gdn import triton_kernels as gdn_tk
from tileport.ops.kda import triton_kernels as kk

if _GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from tileport.ops.gdn.gluon_kernels import (_chunk_bounds, _issue_chunk_tiles, _issue_recurrence_tiles,
                                                _recurrence_buffers, _sequence_program, _store_transposed,
                                                _sum_combine, _transposed_rows)

BT = 64  # the chunk: M of every WGMMA here, one warpgroup of 4 warps
HEAD_DIMS = (64, 128)

__all__ = ["gluon_refusal", "kda_forward_gluon", "kda_backward_gluon", "compile_cases"]


def gluon_refusal(K: int, V: int, dtype: torch.dtype) -> str | None:
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    if dtype != torch.bfloat16:
        return f"{dtype}: the Gluon KDA kernel takes bfloat16 only (fp16 needs bf16 operands, fp32 exact products)"
    if K not in HEAD_DIMS or K != V:
        return f"K={K}, V={V}: the Gluon KDA kernel takes K == V of {HEAD_DIMS}"
    return None


if _GLUON_ERROR is None:

    @gluon.jit
    def _kda_chunk_output(q_b, k_b, vn_b, h_b, kd_b, G_ptr, o_ptr, chunks_ptr, item, H, scale,
                          K: gl.constexpr, V: gl.constexpr):
        """O of work item `item` = c * H + hh (chunk c, head hh) from its q, k, Vn and h tiles,
        already in shared memory: the gate factors are applied in registers (Q's on the way to two
        register A operands, K's on the way to kd_b, the B operand of P's product, which TMA cannot
        give scaled); P masked to its lower triangle and the sequence's rows, then handed to the
        last WGMMA from registers; O stored with a row mask (a varlen chunk's tail rows belong to
        the next sequence)."""
        BT: gl.constexpr = q_b.shape[0]
        c = item // H
        hh = item % H
        bos, eos = _chunk_bounds(chunks_ptr, c)
        # [64, K] tiles: 8 contiguous channels (32 B of fp32 G) per thread, a row in 16 threads
        ROWS_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, V, 16])
        r = gl.arange(0, BT, layout=gl.SliceLayout(1, ROWS_L))
        kc = gl.arange(0, K, layout=gl.SliceLayout(0, ROWS_L))
        valid = (bos + r < eos)[:, None]
        # the middle row as `_chunk_gate_offsets` takes it (eos is the sequence's end, not the chunk's)
        m = bos + (gl.minimum(eos - bos, BT) - 1) // 2
        Gm = gl.load(G_ptr + (m.to(gl.int64) * H + hh) * K + kc)
        # lint: allow TP001 -- G's rows, masked past the sequence, meet Q and K in registers (fp32 or fp64 G: no TMA tile is used as loaded)
        Gt = gl.load(G_ptr + ((bos + r).to(gl.int64) * H + hh)[:, None] * K + kc[None, :], mask=valid, other=0.0)
        d = gl.where(valid, (Gt - Gm[None, :]).to(gl.float32), 0.0)

        kd_b.store((k_b.load(ROWS_L).to(gl.float32) * gl.exp(-d)).to(kd_b.dtype))
        fence_async_shared()  # generic-proxy writes, then the async proxy (WGMMA) reads
        gl.thread_barrier()
        q = q_b.load(ROWS_L).to(gl.float32)
        qd = gl.convert_layout((q * gl.exp(d)).to(q_b.dtype), gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2))
        s = warpgroup_mma(qd, kd_b.permute((1, 0)), gl.zeros([BT, BT], gl.float32, S_L))
        qg = gl.convert_layout((q * gl.exp(d + Gm.to(gl.float32)[None, :])).to(q_b.dtype),
                               gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2))
        o = warpgroup_mma(qg, h_b, gl.zeros([BT, V], gl.float32, O_L))

        rs = gl.arange(0, BT, layout=gl.SliceLayout(1, S_L))
        cs = gl.arange(0, BT, layout=gl.SliceLayout(0, S_L))
        keep = (rs[:, None] >= cs[None, :]) & (bos + rs < eos)[:, None] & (bos + cs < eos)[None, :]
        P = gl.convert_layout(gl.where(keep, s, 0.0).to(vn_b.dtype),
                              gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2))
        o = warpgroup_mma(P, vn_b, o)

        ro = gl.arange(0, BT, layout=gl.SliceLayout(1, O_L))
        co = gl.arange(0, V, layout=gl.SliceLayout(0, O_L))
        offs = ((bos + ro).to(gl.int64) * H + hh)[:, None] * V + co[None, :]
        # lint: allow TP001 -- a varlen chunk's tail rows belong to the next sequence: a 64-row TMA store would overwrite them; the masked store writes only this chunk's rows
        gl.store(o_ptr + offs, (o * scale).to(o_ptr.dtype.element_ty), mask=(bos + ro < eos)[:, None])

    @gluon.jit
    def _kda_output_wgmma_kernel(q_desc, k_desc, vn_desc, h_desc, G_ptr, o_ptr, chunks_ptr, flags_ptr, H, scale,
                                 K: gl.constexpr, V: gl.constexpr):
        """Stage 6 for one chunk and head whose flag (stage 3's, int8 [NC, H]) is clear, in o's dtype;
        grid (NC, H), 4 warps; a flagged chunk's program returns (Triton's block kernel takes it).
        q, k [Ntok, H*K], Vn [Ntok, H*V] and h [NC*H*K, V] (bf16) come in through TMA on one
        mbarrier, G [Ntok, H, K] (fp32 or fp64) by loads into registers.
        Explicit here (Triton would choose): the descriptors and the barrier, the shared buffer of
        the scaled keys and its fence, the accumulator layouts of the three WGMMAs (S [64, 64],
        O [64, V]), which operands come from registers (both scaled Q and P) and which from
        shared memory (h, Vn, and the scaled K^T as a transposed view)."""
        BT: gl.constexpr = q_desc.block_type.shape[0]
        c = gl.program_id(0)
        hh = gl.program_id(1)
        q_s = gl.allocate_shared_memory(q_desc.dtype, [BT, K], q_desc.layout)
        k_s = gl.allocate_shared_memory(k_desc.dtype, [BT, K], k_desc.layout)
        kd_s = gl.allocate_shared_memory(k_desc.dtype, [BT, K], k_desc.layout)
        vn_s = gl.allocate_shared_memory(vn_desc.dtype, [BT, V], vn_desc.layout)
        h_s = gl.allocate_shared_memory(h_desc.dtype, [K, V], h_desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        if gl.load(flags_ptr + c * H + hh) == 0:
            mbarrier.init(bar, count=1)
            fence_async_shared()
            item = c * H + hh
            _issue_chunk_tiles(q_desc, k_desc, vn_desc, h_desc, chunks_ptr, item, H, q_s, k_s, vn_s, h_s, bar, K, V)
            mbarrier.wait(bar, 0)
            _kda_chunk_output(q_s, k_s, vn_s, h_s, kd_s, G_ptr, o_ptr, chunks_ptr, item, H, scale, K, V)
            mbarrier.invalidate(bar)


# --------------------------------------------------------------------------------------------
# Stages 5 and 6 fused: the state recurrence and the unflagged chunks' output, h never leaving the chip
# --------------------------------------------------------------------------------------------
# Which kernels run the forward's stages 5 and 6 in the gluon backend: "split" (Triton's
# `_states_kernel` with PER_CHANNEL stores h [NC, H, K, V] and Vn, then `_kda_output_wgmma_kernel`
# reads them back: 2.14 GB at S1) or "fused" (`_kda_states_output_kernel`: h stays in registers
# and shared memory; only the flagged chunks' h and Vn are stored, for Triton's block kernel).
# Read at each call (`states_output_kernel_for`; scripts/kda_ab.py "recurrence" times both).
# "fused" since the H200 ran it (tests/test_kda_gluon_states.py: bitwise equal to the split form,
# the gate's cases green, f9d498b) and timed it (S1, keeping T, same inputs): the forward 1.618 ->
# 1.426 ms with logsigmoid gates (the kernel 0.535 ms against 0.373 + 0.363 for the two it
# replaces), 13.126 -> 13.312 with steep ones (every chunk flagged: h and Vn stored for all, the
# update waited for at once); docs/perf/kda.md row 25.
# "fused-t": stage 3 stops at T (no W and U formed, stored or read) and the fused kernel forms Vn
# from T, v and beta (its VN_FROM_T) and normalises q (L2NORM_Q). The default since the H200 ran it
# (tests/test_kda_gluon_states.py: within 2^-6 of "fused" route by route, the gate's cases against
# the float64 reference; racecheck clean) and timed it (S1, keeping T, same inputs, one process):
# the forward 1.249 ms ("fused") -> 0.970 (docs/perf/kda.md rows 27, 28).
FORWARD_RECURRENCE = "fused-t"
FORWARD_RECURRENCE_FORMS = ("split", "fused", "fused-t")
# The fused kernel's V columns per program and warps: BV = 128 on two warpgroups side by side
# (GDN's best form, gdn.gluon_kernels.RECURRENCE_BV: one wave of N * H programs at S1), or 64 on one.
RECURRENCE_BV = 128
RECURRENCE_WARPS = 8
# When the fused kernel loads a chunk's gates (its GATES): "top" or "ahead" (the kernel's docstring).
# "ahead" since the H200 timed both (kda_ab "recurrence" at c946a7a, S1, keeping T, same inputs,
# the same o and final state to the bit): the forward 1.388 ms at "top" and 1.256 at "ahead" (the
# kernel 0.503 -> 0.372 ms; the split form 1.614); steep gates 13.284 and 13.255 (split 13.182).
RECURRENCE_GATES = "ahead"
RECURRENCE_GATE_FORMS = ("top", "ahead")
# Where "fused-t" normalises q (its Q_NORM): "in-place" (each chunk's q tile normalised and
# written back over itself at the chunk's top: a shared-memory store and the CTA barrier the
# compiler puts before it, on the chain's first link) or "registers" (normalised where it is read:
# the unflagged chunk's output operands, and a flagged chunk's rows as they are stored for the
# block kernel; q's tile never rewritten). The same bf16 values either way.
Q_NORM = "in-place"
Q_NORM_FORMS = ("in-place", "registers")

if _GLUON_ERROR is None:

    @gluon.jit
    def _chunk_channel_gates(G_ptr, t0, eos, H, hh, rr, kc, kr, K: gl.constexpr):
        """The gates of the chunk from token t0 of a sequence ending at eos, head hh, from G [Ntok, H,
        K]: its [64, K] tile (rows past the sequence 0; rr, kc in the tile's layout), its last row
        G_L in the tile's column layout and in the state's row layout (kr's), and its middle row
        G_m (`_kda_chunk_output`'s); all 0 for a chunk past the sequence (t0 >= eos: the chunk after
        a sequence's last, loaded ahead and never used)."""
        BT: gl.constexpr = rr.shape[0]
        inside = t0 < eos
        last = gl.minimum(t0 + BT, eos) - 1
        mid = t0 + (gl.minimum(eos - t0, BT) - 1) // 2
        g_last = G_ptr + (last.to(gl.int64) * H + hh) * K
        GL_rows = gl.load(g_last + kc, mask=inside & (kc < K), other=0.0)
        GL_state = gl.load(g_last + kr, mask=inside & (kr < K), other=0.0)
        Gm = gl.load(G_ptr + (mid.to(gl.int64) * H + hh) * K + kc, mask=inside & (kc < K), other=0.0)
        r_ok = t0 + rr < eos
        # lint: allow TP001 -- the chunk's per-channel gates meet k and q in registers (no shared memory is left for a third [64, K] TMA tile beside the ring)
        Gt = gl.load(G_ptr + ((t0 + rr).to(gl.int64) * H + hh)[:, None] * K + kc[None, :], mask=r_ok[:, None], other=0.0)
        return Gt, GL_rows, GL_state, Gm

    @gluon.jit
    def _normalised_rows(x, eps, dtype: gl.constexpr, L2NORM: gl.constexpr):
        """x's rows times rsqrt(sum(x^2) + eps), rounded to dtype and back to fp32 (as stage 1's
        `l2norm_fwd` stores them and a kernel reads them back), where L2NORM; x otherwise."""
        if L2NORM:
            return (x * gl.rsqrt(gl.sum(x * x, axis=1) + eps)[:, None]).to(dtype).to(gl.float32)
        else:
            return x

    @gluon.jit
    def _chunk_betas(beta_ptr, t0, eos, H, hh, ro, VN_FROM_T: gl.constexpr):
        """beta [Ntok, H] on the rows of the chunk from token t0 (ro's layout; 0 past the sequence,
        and for the chunk after a sequence's last, loaded ahead and never used), for Vn from T; a
        scalar 0 without VN_FROM_T."""
        if VN_FROM_T:
            return gl.load(beta_ptr + (t0 + ro).to(gl.int64) * H + hh, mask=t0 + ro < eos, other=0.0).to(gl.float32)
        else:
            return 0.0

    @gluon.jit
    def _kda_states_output_kernel(q_desc, k_desc, w_desc, u_desc, o_desc, G_ptr, h0_ptr, ht_ptr, o_ptr, h_ptr, vn_ptr,
                                  cu_ptr, choff_ptr, flags_ptr, H, scale, K: gl.constexpr, V: gl.constexpr,
                                  BV: gl.constexpr, HAS_H0: gl.constexpr, STORE_FINAL: gl.constexpr,
                                  GATES: gl.constexpr, t_desc=None, beta_ptr=None, VN_FROM_T: gl.constexpr = False,
                                  qn_ptr=None, eps=1e-6, L2NORM_Q: gl.constexpr = False,
                                  Q_IN_REGISTERS: gl.constexpr = False, STORE_STATES: gl.constexpr = False):
        """Stages 5 and 6 of KDA's forward in one kernel: one program per (sequence, head, V block of
        BV columns), sequential over the sequence's chunks; grid (N * H, V / BV), 4 or 8 warps (one
        or two warpgroups, each owning BV / WG columns of every [64, BV] and [K, BV] accumulator;
        4 warps at K = 128 spill, 8 do not).
        h [K, BV] fp32 lives in registers (WGMMA accumulator layout), its bf16 copy in shared memory
        (h_s, the state entering the chunk). Per chunk, with G the chunk's per-channel gate sums
        [64, K] (fp32, loaded into registers), G_L its last row:
            Vn = U - W h                                       (bf16 W and h, as Triton's states kernel)
            h <- diag(exp(G_L)) h + (K * exp(G_L - G))^T Vn    (rows past the sequence: 0)
        and, for a chunk whose flag (stage 3's, int8 [NC, H]) is clear, its output as
        `_kda_chunk_output` forms it, with d = G - G_m (m the chunk's middle row):
            O = scale ((Q e^(d + G_m)) h + lower((Q e^d)(K e^-d)^T) Vn)
        with the same bf16 roundings and product order (o and the final state bitwise equal to the
        split form's on the H200: tests/test_kda_gluon_states.py). A flagged chunk (gates spanning more than 60 about G_m, where e^d
        overflows) stores h and Vn instead (bf16, into buffers only flagged chunks write) and
        Triton's `output_flagged_chunks` forms its output after this kernel.

        STORE_STATES (a training forward whose backward takes them instead of recomputing stage 5):
        every chunk stores the h entering it and its Vn, fp32 from the registers they are in
        (h_ptr [NC, H, K, V], vn_ptr [Ntok, H, V]), h under W h's WGMMA and Vn after it; the flagged
        chunks' output reads the same buffers (rounded to bf16 where it loads them, as the kernel
        rounds its own copies: o unchanged).

        VN_FROM_T (FORWARD_RECURRENCE "fused-t"): stage 3 stored T alone (no W, U), u_desc is V's
        and w_desc a stand-in for W's buffer (k's; never loaded), and with W = T diag(beta)(e^G K),
        U = T diag(beta) V:
            Vn = T X,   X = diag(beta) (V - (e^G K) h)
        (e^G K rounded to bf16 into W's one slot, X rounded to bf16 over V's tile; T's tile (fp32,
        or bf16 where stage 3 stored it so: the same operand, half the bytes) by
        TMA (t_desc) into a buffer of its own, the next chunk's issued once every warp has read
        this one's, and met as a bf16 register operand): one more [64, 64] x [64, BV] WGMMA on the chain, and W and U neither
        formed by stage 3 nor read here. Other roundings than the split form's (not bitwise equal:
        tests/test_kda_gluon_states.py bounds the difference and the gate checks it against the
        float64 reference).

        L2NORM_Q (with VN_FROM_T): q is the raw queries, normalised in its tile at the chunk's top (q *
        rsqrt(sum(q^2) + eps) by rows, rounded to bf16 as stage 1's `l2norm_fwd` stores it), so
        stage 1 does not normalise q; a flagged chunk stores its normalised rows to qn_ptr for
        Triton's block kernel. Q_IN_REGISTERS (Q_NORM "registers"): the same values formed where
        q's tile is read instead, the tile left raw.

        Shared memory (K = 128, BV = 128): a ring of two TMA sets of q, k, W [64, K] and U [64, BV]
        (128 KB), h_s 32, Vn 16, the scaled keys 16, o's TMA staging 16: 208 KB, one program per SM.
        The output's three operands that TMA cannot give scaled are written over the chunk's own
        TMA tiles once every warp has read them: Q e^d over q, K e^-d over k, Q e^(d + G_m) over W
        (after W h retired): no buffers beyond GDN's fused kernel's. With VN_FROM_T, W's ring is one
        slot (16 KB freed) and T's fp32 tile takes 16 KB of its own: 212 KB.

        GATES: when a chunk's gates (G's [64, K] tile, G_L and G_m) are loaded: "top" (at the top of
        the chunk, before its tiles are waited for; with the ring two deep those are usually in,
        so the loads' latency is exposed) or "ahead" (at the end of the previous chunk, after its
        WGMMAs retired, where the tile's 32 registers a thread are free: in flight under that
        chunk's stores, barrier and refill).

        Explicit here (Triton would choose): the TMA ring and its refill point, the accumulator
        layouts, which WGMMAs run asynchronously and the order they are waited for (W h alone
        first: the chain's first link; S and Q h before the update, so P is formed while the update
        runs), the thread barriers and fences that order the generic-proxy stores (h_s, Vn, the
        scaled operands) before the WGMMAs (async proxy) read them and every warpgroup's reads of a
        buffer before it is rewritten, and o's TMA store for chunks whose rows are all the
        sequence's (a tail chunk keeps a masked store: its TMA rows are the next sequence's). Why:
        the split form stores h and Vn (1.07 GB at S1) and reads them, q, k and G back (1.07 GB)
        in 0.73 ms; the forward's 0.90 ms goal is below that dataflow's floor (docs/perf/kda.md)."""
        BT: gl.constexpr = q_desc.block_type.shape[0]
        NW: gl.constexpr = gl.num_warps()
        WG: gl.constexpr = NW // 4
        RING: gl.constexpr = 2
        n, hh, jv, bos, eos, nc = _sequence_program(cu_ptr, H, BT)
        c0 = gl.load(choff_ptr + n).to(gl.int32)  # the sequence's first chunk: the flags' row

        WITH_W: gl.constexpr = not VN_FROM_T
        W_SLOTS: gl.constexpr = RING if WITH_W else 1  # W's operand formed here is used within its chunk
        q_s, k_s, w_s, u_s, h_s, vn_s, kd_s, o_s, bars = _recurrence_buffers(q_desc, k_desc, w_desc, u_desc, o_desc, K, BV,
                                                                             RING, True, W_SLOTS)
        if VN_FROM_T:
            t_s = gl.allocate_shared_memory(t_desc.dtype, [BT, BT], t_desc.layout)
            t_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(t_bar, count=1)
            fence_async_shared()

        V_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, BV // WG, 16])
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, BT // WG, 16])
        # [64, K] tiles (G, k, q and the scaled operands): 8 contiguous channels a thread and a row's
        # K channels in one pass of a warp's lanes, so the row vectors G_L and G_m cost 8 registers
        # a thread each (with 8 lanes a row at K = 128 they cost 16, and the kernel spilled)
        ROWS_L: gl.constexpr = gl.BlockedLayout([1, 8], [256 // K, K // 8], [NW, 1], [1, 0])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=V_L, k_width=2)

        kr = gl.arange(0, K, layout=gl.SliceLayout(1, V_L))
        vcol = gl.arange(0, BV, layout=gl.SliceLayout(0, V_L))
        in_state = kr[:, None] * V + (jv * BV + vcol)[None, :]  # [K, BV] block of a [K, V] state
        sbase = (n.to(gl.int64) * H + hh) * (K * V)
        if HAS_H0:
            # lint: allow TP001 -- once per program, outside the chunk loop: the fp32 state straight into the WGMMA accumulator layout it is used in
            h = gl.load(h0_ptr + sbase + in_state).to(gl.float32)
        else:
            h = gl.zeros([K, BV], gl.float32, V_L)
        h_s.store(h.to(h_s.dtype))

        if nc > 0:
            _issue_recurrence_tiles(q_desc, k_desc, w_desc, u_desc, bos, hh, hh * V + jv * BV, q_s.index(0),
                                    k_s.index(0), w_s.index(0), u_s.index(0), bars.index(0), K, WITH_W)
            if VN_FROM_T:
                mbarrier.expect(t_bar, t_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(t_desc, [bos, hh * BT], t_bar, t_s)
        rr = gl.arange(0, BT, layout=gl.SliceLayout(1, ROWS_L))
        kc = gl.arange(0, K, layout=gl.SliceLayout(0, ROWS_L))
        ro = gl.arange(0, BT, layout=gl.SliceLayout(1, V_L))
        rs = gl.arange(0, BT, layout=gl.SliceLayout(1, S_L))
        cs = gl.arange(0, BT, layout=gl.SliceLayout(0, S_L))
        if GATES == "ahead":
            Gt, GL_rows, GL_state, Gm = _chunk_channel_gates(G_ptr, bos, eos, H, hh, rr, kc, kr, K)
            b_acc = _chunk_betas(beta_ptr, bos, eos, H, hh, ro, VN_FROM_T)
        for i in range(nc):
            buf = i % RING
            t0 = bos + i * BT
            if i + 1 < nc:
                # every warpgroup's WGMMAs of chunk i - 1 (the last readers of set 1 - buf, its
                # scaled operands included) were waited for before the barrier that ended it; this
                # one keeps the refill safe on its own, as in GDN's fused kernel
                gl.thread_barrier()
                _issue_recurrence_tiles(q_desc, k_desc, w_desc, u_desc, t0 + BT, hh, hh * V + jv * BV,
                                        q_s.index(1 - buf), k_s.index(1 - buf), w_s.index((1 - buf) % W_SLOTS),
                                        u_s.index(1 - buf), bars.index(1 - buf), K, WITH_W)
            r_ok = t0 + rr < eos
            ro_ok = t0 + ro < eos
            unflagged = gl.load(flags_ptr + (c0 + i) * H + hh) == 0
            if GATES == "top":
                # the chunk's gates, before its tiles are waited for (their latency partly under the wait)
                Gt, GL_rows, GL_state, Gm = _chunk_channel_gates(G_ptr, t0, eos, H, hh, rr, kc, kr, K)
                b_acc = _chunk_betas(beta_ptr, t0, eos, H, hh, ro, VN_FROM_T)
            mbarrier.wait(bars.index(buf), (i // RING) & 1)
            if L2NORM_Q and not Q_IN_REGISTERS:
                # q's rows normalised in place: each thread rewrites the elements it read (ROWS_L
                # both ways); read back after the barriers below
                qn = _normalised_rows(q_s.index(buf).load(ROWS_L).to(gl.float32), eps, q_s.dtype, True)
                q_s.index(buf).store(qn.to(q_s.dtype))
            if VN_FROM_T:
                # e^G K for W h, and the scaled keys K exp(G_L - G) (rows past the sequence: 0)
                kf = k_s.index(buf).load(ROWS_L).to(gl.float32)
                w_s.index(buf % W_SLOTS).store((kf * gl.exp(Gt.to(gl.float32))).to(w_s.dtype))
                kd = kf * gl.exp(gl.where(r_ok[:, None], (GL_rows[None, :] - Gt).to(gl.float32), float("-inf")))
                kd_s.store(kd.to(kd_s.dtype))
            fence_async_shared()  # h_s (and W's slot), written by the generic proxy, read by WGMMA
            gl.thread_barrier()

            wh = warpgroup_mma(w_s.index(buf % W_SLOTS), h_s, gl.zeros([BT, BV], gl.float32, V_L), is_async=True)
            if STORE_STATES:
                # lint: allow TP001 -- the backward's h, from the accumulator registers it is in (under W h)
                gl.store(h_ptr + ((c0 + i).to(gl.int64) * H + hh) * (K * V) + in_state, h.to(h_ptr.dtype.element_ty))
            if not VN_FROM_T:
                kf = k_s.index(buf).load(ROWS_L).to(gl.float32)
                # the scaled keys K exp(G_L - G) (rows past the sequence: 0), under W h
                kd = kf * gl.exp(gl.where(r_ok[:, None], (GL_rows[None, :] - Gt).to(gl.float32), float("-inf")))
                kd_s.store(kd.to(kd_s.dtype))
            u_r = u_s.index(buf).load(V_L).to(gl.float32)
            wh = warpgroup_mma_wait(0, deps=[wh])
            if VN_FROM_T:
                # X over V's tile: each thread rewrites the elements it read (V_L both ways)
                # lint: allow TP005 -- V's tile is no WGMMA's operand until T X below (W h, waited for, read W's slot and h_s)
                u_s.index(buf).store((b_acc[:, None] * (u_r - wh)).to(u_s.dtype))  # rows past the sequence: beta 0
                mbarrier.wait(t_bar, i & 1)
                Tb = t_s.load(P_L).to(u_s.dtype)  # T's rows straight into the WGMMA's register operand layout
                fence_async_shared()
                gl.thread_barrier()  # every warp's X before the product reads it; every warp has read T
                if i + 1 < nc:  # the next chunk's T, under the rest of this one
                    mbarrier.expect(t_bar, t_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(t_desc, [t0 + BT, hh * BT], t_bar, t_s)
                vn = warpgroup_mma(Tb, u_s.index(buf), gl.zeros([BT, BV], gl.float32, V_L))
            else:
                vn = u_r - wh
            # lint: allow TP005 -- vn_s's readers (chunk i - 1's update and P Vn) were waited for (wait 0) before the thread barrier that ends that chunk
            vn_s.store(vn.to(vn_s.dtype))
            if STORE_STATES:
                offs = ((t0 + ro).to(gl.int64) * H + hh)[:, None] * V + (jv * BV + vcol)[None, :]
                # lint: allow TP001 -- the backward's Vn in fp32; a tail chunk's rows past the sequence are the next one's
                gl.store(vn_ptr + offs, vn.to(vn_ptr.dtype.element_ty), mask=ro_ok[:, None])
            if unflagged:
                # the output's operands, `_kda_chunk_output`'s exactly
                if VN_FROM_T:  # k read again (its tile is intact): not held in registers across the chain
                    kf = k_s.index(buf).load(ROWS_L).to(gl.float32)
                d = gl.where(r_ok[:, None], (Gt - Gm[None, :]).to(gl.float32), 0.0)
                ke = (kf * gl.exp(-d)).to(k_s.dtype)
                qf = _normalised_rows(q_s.index(buf).load(ROWS_L).to(gl.float32), eps, q_s.dtype,
                                      L2NORM_Q and Q_IN_REGISTERS)
                qd = (qf * gl.exp(d)).to(q_s.dtype)
                qg = (qf * gl.exp(d + Gm.to(gl.float32)[None, :])).to(w_s.dtype)
                gl.thread_barrier()  # every warp has read k and q, and waited for its W h, before they are overwritten
                k_s.index(buf).store(ke)
                q_s.index(buf).store(qd)
                w_s.index(buf % W_SLOTS).store(qg)
                tma.store_wait(0)  # chunk i - 1's o has left o_s; the barrier below tells every warp
                fence_async_shared()
                gl.thread_barrier()  # Vn, the scaled keys and the output's operands of every warp
                sqk = warpgroup_mma(q_s.index(buf), k_s.index(buf).permute((1, 0)),
                                    gl.zeros([BT, BT], gl.float32, S_L), is_async=True)
                qh = warpgroup_mma(w_s.index(buf % W_SLOTS), h_s, gl.zeros([BT, BV], gl.float32, V_L), is_async=True)
                h = warpgroup_mma(kd_s.permute((1, 0)), vn_s, h * gl.exp(GL_state.to(gl.float32))[:, None],
                                  is_async=True)
                sqk, qh = warpgroup_mma_wait(1, deps=[sqk, qh])  # the update runs on under P
                keep = (rs[:, None] >= cs[None, :]) & (t0 + rs < eos)[:, None] & (t0 + cs < eos)[None, :]
                P = gl.convert_layout(gl.where(keep, sqk, 0.0).to(vn_s.dtype), P_L)
                o = warpgroup_mma(P, vn_s, qh, is_async=True)
                h, o = warpgroup_mma_wait(0, deps=[h, o])
                if t0 + BT <= eos:
                    o_s.store((o * scale).to(o_s.dtype))
                    fence_async_shared()
                else:
                    offs = ((t0 + ro).to(gl.int64) * H + hh)[:, None] * V + (jv * BV + vcol)[None, :]
                    # lint: allow TP001 -- a varlen chunk's tail rows belong to the next sequence: a 64-row TMA store would overwrite them
                    gl.store(o_ptr + offs, (o * scale).to(o_ptr.dtype.element_ty), mask=ro_ok[:, None])
            else:
                if L2NORM_Q:  # the block kernel's queries: this chunk's rows, normalised (in q's tile, or here)
                    qn = _normalised_rows(q_s.index(buf).load(ROWS_L).to(gl.float32), eps, q_s.dtype, Q_IN_REGISTERS)
                    # lint: allow TP001 -- only flagged chunks store their normalised queries; a tail chunk's rows past the sequence are the next one's
                    gl.store(qn_ptr + (t0.to(gl.int64) * H + hh) * K + (rr * (H * K))[:, None] + kc[None, :],
                             qn.to(qn_ptr.dtype.element_ty), mask=r_ok[:, None])
                # Triton's block kernel forms this chunk's output from the h entering it and Vn
                if not STORE_STATES:  # (stored above for every chunk otherwise)
                    # lint: allow TP001 -- only flagged chunks store h and Vn, from the registers they are in
                    gl.store(h_ptr + ((c0 + i).to(gl.int64) * H + hh) * (K * V) + in_state,
                             h.to(h_ptr.dtype.element_ty))
                    offs = ((t0 + ro).to(gl.int64) * H + hh)[:, None] * V + (jv * BV + vcol)[None, :]
                    # lint: allow TP001 -- only flagged chunks store Vn; a tail chunk's rows past the sequence are the next one's
                    gl.store(vn_ptr + offs, vn.to(vn_ptr.dtype.element_ty), mask=ro_ok[:, None])
                fence_async_shared()
                gl.thread_barrier()  # Vn and the scaled keys of every warp, before the update reads them
                h = warpgroup_mma(kd_s.permute((1, 0)), vn_s, h * gl.exp(GL_state.to(gl.float32))[:, None])
            if GATES == "ahead":  # the next chunk's gates, in flight under this chunk's stores and barriers
                Gt, GL_rows, GL_state, Gm = _chunk_channel_gates(G_ptr, t0 + BT, eos, H, hh, rr, kc, kr, K)
                b_acc = _chunk_betas(beta_ptr, t0 + BT, eos, H, hh, ro, VN_FROM_T)
            gl.thread_barrier()  # every warpgroup's WGMMAs have read h_s, vn_s and kd_s; o_s is whole
            if unflagged & (t0 + BT <= eos):
                tma.async_copy_shared_to_global(o_desc, [t0, hh * V + jv * BV], o_s)
            h_s.store(h.to(h_s.dtype))
        tma.store_wait(0)  # o_s is read by the last TMA store until it completes
        if STORE_FINAL:
            # lint: allow TP001 -- once per program, after the chunk loop: the state from its accumulator layout
            gl.store(ht_ptr + sbase + in_state, h)
        for b in gl.static_range(RING):
            mbarrier.invalidate(bars.index(b))
        if VN_FROM_T:
            mbarrier.invalidate(t_bar)


def states_output_kernel_for(q, k, v, G, span_flags) -> str:
    """"split", "fused" or "fused-t": how the forward's stages 5 and 6 run on these operands
    (FORWARD_RECURRENCE), decided before stage 3 (which "fused-t" stops at T). A fused form needs
    stage 3's flags (so the flagged chunks' output has its route), bf16 q, k and v (so W and U are
    bf16 too, stage 3's compact form) with K == V of HEAD_DIMS, fp32 G, all contiguous and 16-byte
    aligned for TMA, on the GPU; "split" otherwise."""
    form = kk._checked("FORWARD_RECURRENCE", FORWARD_RECURRENCE, FORWARD_RECURRENCE_FORMS)
    kk._checked("Q_NORM", Q_NORM, Q_NORM_FORMS)
    if form == "split" or _GLUON_ERROR is not None:
        return "split"
    if span_flags is None or not G.is_cuda:
        return "split"
    K, V = k.shape[-1], v.shape[-1]
    if K != V or K not in HEAD_DIMS or any(x.dtype != torch.bfloat16 for x in (q, k, v)):
        return "split"
    if G.dtype != torch.float32 or not all(x.is_contiguous() for x in (q, k, v, G)):
        return "split"
    if any(x.data_ptr() % 16 for x in (q, k, v)):  # TMA descriptors' bases
        return "split"
    return form


def check_recurrence_launch(V: int) -> int:
    """The fused kernel's BV for head dim V (RECURRENCE_BV, RECURRENCE_WARPS, checked as GDN's are),
    or a ValueError naming the switch it cannot take."""
    kk._checked("RECURRENCE_GATES", RECURRENCE_GATES, RECURRENCE_GATE_FORMS)
    return recurrence_block(V, RECURRENCE_BV, RECURRENCE_WARPS)


def chunk_states_output_kda_gluon(q, k, G, h0, plan, output_final_state: bool, scale: float, span_flags,
                                  w=None, u=None, T=None, v=None, beta=None, l2norm_q: bool = False, worklist=None,
                                  states_out=None):
    """Stages 5 and 6 on `_kda_states_output_kernel`, then Triton's block kernel on the flagged
    chunks: (o [Ntok, H, V] bf16, final state [N, H, K, V] fp32 or None) from normalised k (bf16),
    q (bf16; normalised, or raw with l2norm_q: the kernel normalises it) and G [Ntok, H, K] fp32,
    where `states_output_kernel_for` chose a fused form, with either W and U (bf16, stage 3's
    compact form: "fused") or T [Ntok, H, 64] (fp32, or bf16 as the kernel rounds it), v and beta
    ("fused-t": Vn formed from T in the kernel; l2norm_q only there). worklist: the flags'
    `flagged_worklist`, where the forward formed it with stage 3 (else formed here for the flagged
    chunks' output). states_out: (h [NC, H, K, V], Vn [Ntok, H, V]) buffers, fp32 or bf16
    (triton_kernels.KEPT_STATES_DTYPE), that every chunk's h entering it and Vn are written into
    ("fused-t" only; STORE_STATES), for a backward that takes them instead of recomputing stage 5."""
    from_t = T is not None
    given = [x is not None for x in (w, u, T, v, beta)]
    if given not in ([True, True, False, False, False], [False, False, True, True, True]):
        raise ValueError("chunk_states_output_kda_gluon takes either w and u, or T, v and beta")
    if l2norm_q and not from_t:
        raise ValueError("l2norm_q: the kernel normalises q in its Vn-from-T form only (T, v and beta)")
    if states_out is not None and not from_t:
        raise ValueError("states_out: the kernel stores every chunk's h and Vn in its Vn-from-T form only (T, v and beta)")
    Ntok, H, K = q.shape
    V = (v if from_t else u).shape[-1]
    BV = check_recurrence_launch(V)
    if span_flags.shape != (plan.NC, H) or span_flags.dtype != torch.int8:
        raise ValueError(f"span_flags must be int8 [{plan.NC}, {H}], got {span_flags.dtype} {tuple(span_flags.shape)}")
    if from_t and (T.shape != (Ntok, H, BT) or T.dtype not in (torch.float32, v.dtype) or beta.shape != (Ntok, H)):
        raise ValueError(f"T must be fp32 or v's dtype, [{Ntok}, {H}, {BT}], and beta [{Ntok}, {H}], got T {T.dtype} "
                         f"{tuple(T.shape)}, beta {tuple(beta.shape)}")
    o = new_empty((Ntok, H, V), torch.bfloat16, q.device)
    ht = new_empty((plan.N, H, K, V), torch.float32, q.device) if output_final_state else None
    if states_out is not None:
        h, vn = states_out
        if (h.shape, vn.shape) != ((plan.NC, H, K, V), (Ntok, H, V)) or h.dtype not in (torch.float32, torch.bfloat16) \
                or vn.dtype != h.dtype or not (h.is_contiguous() and vn.is_contiguous()):
            raise ValueError(f"states_out must be contiguous h [{plan.NC}, {H}, {K}, {V}] and Vn [{Ntok}, {H}, {V}], both "
                             f"fp32 or both bf16, got {h.dtype} {tuple(h.shape)} and {vn.dtype} {tuple(vn.shape)}")
    else:  # written for the flagged chunks only (Triton's block kernel reads no other)
        h = new_empty((plan.NC, H, K, V), torch.bfloat16, q.device)
        vn = new_empty((Ntok, H, V), torch.bfloat16, q.device)
    qn = new_empty((Ntok, H, K), torch.bfloat16, q.device) if l2norm_q else q
    if plan.N:
        q_desc, k_desc = _descriptor(q.view(Ntok, H * K), [BT, K]), _descriptor(k.view(Ntok, H * K), [BT, K])
        # "fused-t": k's descriptor stands in for W's (the buffers' type; nothing is loaded through it)
        w_desc = k_desc if from_t else _descriptor(w.view(Ntok, H * K), [BT, K])
        u_desc = _descriptor((v if from_t else u).view(Ntok, H * V), [BT, BV])
        o_desc = _descriptor(o.view(Ntok, H * V), [BT, BV])
        t_desc = _descriptor(T.view(Ntok, H * BT), [BT, BT]) if from_t else None
        h0 = h0.float().contiguous() if h0 is not None else None
        _kda_states_output_kernel[(plan.N * H, V // BV)](
            q_desc, k_desc, w_desc, u_desc, o_desc, G, h0 if h0 is not None else o, ht if ht is not None else o, o, h,
            vn, plan.cu, plan.chunk_offsets, span_flags, H, float(scale), K, V, BV, h0 is not None,
            output_final_state, RECURRENCE_GATES, t_desc, beta.contiguous() if from_t else None,
            from_t, qn, gdn_tk.L2NORM_EPS, l2norm_q,
            l2norm_q and kk._checked("Q_NORM", Q_NORM, Q_NORM_FORMS) == "registers", states_out is not None,
            num_warps=RECURRENCE_WARPS)
        kk.output_flagged_chunks(qn, k, G, h, vn, o, scale, plan, span_flags, worklist=worklist)
    return o, ht


# --------------------------------------------------------------------------------------------
# Stage 3 (G, the flags, T, W and U) on WGMMA, for the forward of l2-normalised bf16 keys
# --------------------------------------------------------------------------------------------
# Which kernel forms stage 3 in the gluon backend's forward: "triton" (`_solve_wu_tile_kernel`
# with PER_CHANNEL and CUMSUM_G, every chunk) or "gluon" (`_kda_solve_wgmma_kernel` forms G and the
# flags of every chunk and T, W, U of the unflagged ones; Triton's `_solve_wu_kernel` the flagged
# ones, as after the tile kernel). Read at each call. "triton": the Gluon kernel agrees with it
# bitwise but is slower (H200, kda_ab "solve", S1, keeping T: 0.915 ms against 0.72 per forward,
# the forward 1.808 against 1.606 ms; docs/perf/kda.md row 24). It stays as the TMA + WGMMA step of
# the port, tested (tests/test_kda_gluon_solve.py), for the scheduling step that is still to come.
FORWARD_SOLVE = "triton"
# `_solve_wu_tile_kernel`'s SPAN_MAX: a chunk is flagged where its gates span more than this about
# its middle row. The output and backward kernels read the flags, so both stage-3 kernels must flag
# the same chunks (tests/test_kda_gluon_solve.py checks the two constants agree).
CHUNK_SPAN_MAX = 60.0
SOLVE_CW = 32  # key (and value) channels per TMA block of the solve kernel: its first phase works by them

if _GLUON_ERROR is None:

    @gluon.jit
    def _kda_solve_wgmma_kernel(g_desc, k_desc, v_desc, beta_ptr, G_ptr, t_ptr, w_ptr, u_ptr, chunks_ptr, flags_ptr, H,
                                K: gl.constexpr, V: gl.constexpr, STORE_T: gl.constexpr, SPAN_MAX: gl.constexpr):
        """Stage 3 of the forward for one chunk and head, as Triton's `_solve_wu_tile_kernel` forms
        it with PER_CHANNEL and CUMSUM_G at the forward's precisions for normalised 16-bit keys
        (NORMALISED_KEYS_PREC "bf16", NORMALISED_KEYS_DIAG_PREC "tf32"); grid (NC, H), 4 warps (one
        warpgroup). By blocks of CW key channels (the descriptors' block width):
            G = the chunk's cumulative sum of g (fp64, stored fp32),  d = G - G_m (m its middle row)
        and the flag (span = max |d| > SPAN_MAX) of every chunk; then, where the flag is clear:
            A = strict_lower(diag(beta) (K e^d)(K e^-d)^T)               bf16 WGMMAs over K
            D = (I + blockdiag16(A))^-1 = (I - N)(I + N^2)(I + N^4)(I + N^8)   tf32 WGMMAs
            M = D A_off,  T = (I - M + M^2 - M^3) D (Horner)              bf16 WGMMAs
            W = T (diag(beta) e^G K),  U = T diag(beta) V                 bf16 WGMMAs
        with the operands rounded as Triton's kernel rounds them and the products in its order (on
        the H200 the two agreed bitwise: tests/test_kda_gluon_solve.py; not promised: Triton's
        diagonal inverses are batched 16x16 dots, ours one block-diagonal [64, 64] WGMMA whose
        zero products add exactly, and the two fp64 scans may add in other orders). T is stored fp32 (STORE_T:
        the forward keeps it for the backward), W and U in their buffers' dtype. A flagged chunk
        stops after its G and flag (Triton's block kernel forms it).
        Explicit here (Triton would choose): every input tile of the chunk (g, k, v by blocks of CW
        channels) comes by TMA at the start on one barrier, so their latencies overlap; the gated
        keys and the W and U operands are formed in shared memory in place (K e^-d over k's block,
        diag(beta) V over v's) or beside (diag(beta) e^G K), K e^d as a register A operand; A's
        diagonal 16x16 blocks are inverted as one block-diagonal [64, 64] tile on tensor cores (4x
        the products of Triton's batched 16x16 ones, off the memory path); the tf32 chain's B
        operands (N^(2^i) transposed) reuse g's slots once those are read (where large enough).
        H200 (S1, docs/perf/kda.md row 24): 0.915 ms per forward against Triton's 0.72, two programs
        an SM (204 registers; 86 KB then, with the bf16 chain's slots in k's, 102 KB since they have
        their own: compile-checked, not re-timed). The form that loaded g, k and v into registers block by block
        took 1.17 ms (ncu: 35% of warp stalls on those loads, 17% of DRAM bandwidth, 185 M
        instructions, as many as Triton's kernel; 8 warps an SM, no eligible warp 82% of cycles):
        latency-bound, as this one still is. Not tried yet: software pipelining across chunks (the
        next chunk's tiles under this one's chains). Tried, broken: v's tiles in g's slots (a
        bf16 view of the fp32 buffer by `_reinterpret`, 70 KB, three programs an SM) made the U
        products' WGMMA read shared memory out of bounds (compute-sanitizer) under triton 3.6."""
        BT: gl.constexpr = g_desc.block_type.shape[0]
        CW: gl.constexpr = g_desc.block_type.shape[1]
        NB: gl.constexpr = K // CW
        NBV: gl.constexpr = V // CW
        gl.static_assert(K % CW == 0 and V % CW == 0, "whole blocks of channels")
        gl.static_assert(gl.num_warps() == 4, "one warpgroup: M = 64 rows of every WGMMA")
        c = gl.program_id(0)
        hh = gl.program_id(1)
        # a block's [64, CW] tiles as read from shared memory: each column's 64 rows in one warp (the
        # scan's axis), 8 of them a thread (scanned in the thread, then over 8 lanes; 2 rows a thread
        # and 32 lanes measured alike on the H200: 0.915 ms against ~0.91 per forward at S1)
        SCAN_L: gl.constexpr = gl.BlockedLayout([8, CW // 16], [BT // 8, 4], [1, 4], [1, 0])
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
        F_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 8])
        W_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, CW, 16])
        KP_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)
        T16_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.bfloat16)
        T32_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float32)
        g_s = gl.allocate_shared_memory(g_desc.dtype, [NB, BT, CW], g_desc.layout)
        k_s = gl.allocate_shared_memory(k_desc.dtype, [NB, BT, CW], k_desc.layout)  # k, then K e^-d in place
        v_s = gl.allocate_shared_memory(v_desc.dtype, [NBV, BT, CW], v_desc.layout)  # v, then diag(beta) V in place
        kw_s = gl.allocate_shared_memory(k_desc.dtype, [NB, BT, CW], k_desc.layout)  # diag(beta) e^G K
        # the tf32 chain's B operands (two [64, 64] fp32 slots) in g's slots once those are read, where
        # they are large enough (K = 128, fp32 g: the same 128-byte swizzle), else their own
        if NB * CW * g_desc.dtype.primitive_bitwidth >= 2 * BT * 32:
            x32_s = g_s._reinterpret(gl.float32, [2, BT, BT], T32_SL)  # N^(2^i) transposed: B of the tf32 chain
        else:
            x32_s = gl.allocate_shared_memory(gl.float32, [2, BT, BT], T32_SL)
        # A_off, then T: B of the bf16 chain, on their own: a 128-byte-swizzled view of k's 64-byte
        # swizzled slots would need their base 1024-byte aligned, which the allocator does not promise
        x16_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BT], T16_SL)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        bos, eos = _chunk_bounds(chunks_ptr, c)
        mbarrier.init(bar, count=1)
        fence_async_shared()
        mbarrier.expect(bar, NB * (g_desc.block_type.nbytes + k_desc.block_type.nbytes)
                        + NBV * v_desc.block_type.nbytes)
        for j in gl.static_range(NB):
            tma.async_copy_global_to_shared(g_desc, [bos, hh * K + j * CW], bar, g_s.index(j))
            tma.async_copy_global_to_shared(k_desc, [bos, hh * K + j * CW], bar, k_s.index(j))
        for j in gl.static_range(NBV):
            tma.async_copy_global_to_shared(v_desc, [bos, hh * V + j * CW], bar, v_s.index(j))

        rl = gl.arange(0, BT, layout=gl.SliceLayout(1, SCAN_L))
        cl = gl.arange(0, CW, layout=gl.SliceLayout(0, SCAN_L))
        ok_l = (bos + rl < eos)[:, None]
        rows_l = ((bos + rl).to(gl.int64) * H + hh)[:, None]
        mloc = (gl.minimum(eos - bos, BT) - 1) // 2  # the middle row as `_chunk_gate_offsets` takes it
        # lint: allow TP001 -- beta's 64 values as a [64, 1] column in the tiles' layout (2 bytes a row: no TMA box), under the TMA loads
        beta_l = gl.load(beta_ptr + rows_l, mask=ok_l, other=0.0).to(gl.float32)
        span = gl.max(gl.zeros([BT], gl.float32, gl.SliceLayout(1, SCAN_L)), axis=0)
        s = gl.zeros([BT, BT], gl.float32, S_L)
        mbarrier.wait(bar, 0)
        # the tail rows of a varlen chunk (the next sequence's, or TMA's zeros past the tensor) are
        # zeroed as they are read, as Triton's masked loads read them
        for j in gl.static_range(NB):
            Gf = gl.associative_scan(gl.where(ok_l, g_s.index(j).load(SCAN_L), 0.0).to(gl.float64), 0,
                                     _sum_combine).to(gl.float32)
            # lint: allow TP001 -- G leaves from the scan's layout, 16-byte vectors; a varlen tail's rows belong to the next sequence (masked)
            gl.store(G_ptr + rows_l * K + (j * CW + cl)[None, :], Gf, mask=ok_l)
            Gm = gl.sum(gl.where((rl == mloc)[:, None], Gf, 0.0), axis=0)
            d = gl.where(ok_l, Gf - Gm[None, :], 0.0)
            span = gl.maximum(span, gl.max(gl.max(gl.abs(d), axis=1), axis=0))
            kf = gl.where(ok_l, k_s.index(j).load(SCAN_L).to(gl.float32), 0.0)
            kw_s.index(j).store((kf * gl.exp(Gf) * beta_l).to(kw_s.dtype))
            kp = gl.convert_layout((kf * gl.exp(d)).to(k_s.dtype), KP_L)
            # in place: each thread overwrites the elements it read
            k_s.index(j).store((kf * gl.exp(-d)).to(k_s.dtype))
            fence_async_shared()
            gl.thread_barrier()  # every warp's part of K e^-d's block before the WGMMA reads it
            if j > 0:  # the previous block's product ran under this block's scan and gating
                s, _kp, _kn = warpgroup_mma_wait(0, deps=[s, kp_prev, k_s.index(j - 1)])
            s = warpgroup_mma(kp, k_s.index(j).permute((1, 0)), s, is_async=True)
            kp_prev = kp
        for j in gl.static_range(NBV):
            v_s.index(j).store((gl.where(ok_l, v_s.index(j).load(SCAN_L).to(gl.float32), 0.0) * beta_l).to(v_s.dtype))
        s, _kp, _kn = warpgroup_mma_wait(0, deps=[s, kp_prev, k_s.index(NB - 1)])
        gl.store(flags_ptr + c * H + hh, gl.where(span <= SPAN_MAX, 0, 1).to(gl.int8))
        if span <= SPAN_MAX:
            rs = gl.arange(0, BT, layout=gl.SliceLayout(1, S_L))
            cs = gl.arange(0, BT, layout=gl.SliceLayout(0, S_L))
            r_ok = bos + rs < eos
            beta = gl.load(beta_ptr + (bos + rs).to(gl.int64) * H + hh, mask=r_ok, other=0.0).to(gl.float32)
            strict = (rs[:, None] > cs[None, :]) & r_ok[:, None] & (bos + cs < eos)[None, :]
            A = gl.where(strict, s * beta[:, None], 0.0)
            same = (rs // 16)[:, None] == (cs // 16)[None, :]
            # D: the diagonal blocks' inverse by doubling on tf32 WGMMAs (N^16 = 0), P <- P (I + N^(2^i))
            # and the next square issued together (both read N^(2^i) from one shared slot); the
            # slots may be g's, read by every warp before the barrier that ended the first phase
            F32_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=F_L, k_width=1)
            N = gl.convert_layout(gl.where(same, A, 0.0), F_L)
            P = gl.convert_layout(gl.where(rs[:, None] == cs[None, :], 1.0, 0.0), F_L) - N
            x32_s.index(0).store(gl.permute(N, (1, 0)))
            fence_async_shared()
            gl.thread_barrier()  # every warp's part of N^T before the WGMMA reads it
            aN = gl.convert_layout(N, F32_OP)
            N = warpgroup_mma(aN, x32_s.index(0).permute((1, 0)), gl.zeros([BT, BT], gl.float32, F_L), is_async=True)
            N, aN = warpgroup_mma_wait(0, deps=[N, aN])
            for i in gl.static_range(3):  # N is N^(2^(i + 1)) here
                slot = x32_s.index((i + 1) % 2)  # the other slot's last reader retired before the barrier above
                slot.store(gl.permute(N, (1, 0)))
                fence_async_shared()
                gl.thread_barrier()
                aP = gl.convert_layout(P, F32_OP)
                P = warpgroup_mma(aP, slot.permute((1, 0)), P, is_async=True)
                if i < 2:
                    aN = gl.convert_layout(N, F32_OP)
                    N = warpgroup_mma(aN, slot.permute((1, 0)), gl.zeros([BT, BT], gl.float32, F_L), is_async=True)
                    P, N, aP, aN = warpgroup_mma_wait(0, deps=[P, N, aP, aN])
                else:
                    P, aP = warpgroup_mma_wait(0, deps=[P, aP])
            D = gl.convert_layout(P, S_L)
            # M = D A_off, then Horner T = D - M (D - M (D - M D)): bf16 operands, fp32 accumulation
            A16_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)
            x16_s.index(0).store(gl.where((rs // 16)[:, None] > (cs // 16)[None, :], A, 0.0).to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            aD = gl.convert_layout(D.to(gl.bfloat16), A16_L)
            M = warpgroup_mma(aD, x16_s.index(0), gl.zeros([BT, BT], gl.float32, S_L), is_async=True)
            M, aD = warpgroup_mma_wait(0, deps=[M, aD])
            aM = gl.convert_layout(M.to(gl.bfloat16), A16_L)
            Tm = D
            for i in gl.static_range(3):
                x16_s.index((i + 1) % 2).store(Tm.to(gl.bfloat16))
                fence_async_shared()
                gl.thread_barrier()
                MT = warpgroup_mma(aM, x16_s.index((i + 1) % 2), gl.zeros([BT, BT], gl.float32, S_L), is_async=True)
                MT, aM = warpgroup_mma_wait(0, deps=[MT, aM])
                Tm = D - MT
            # W and U, a block of CW columns at a time, from T as a register A operand
            aT = gl.convert_layout(Tm.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=W_L, k_width=2))
            ro = gl.arange(0, BT, layout=gl.SliceLayout(1, W_L))
            co = gl.arange(0, CW, layout=gl.SliceLayout(0, W_L))
            o_ok = (bos + ro < eos)[:, None]
            orows = ((bos + ro).to(gl.int64) * H + hh)[:, None]
            zero = gl.zeros([BT, CW], gl.float32, W_L)
            for j in gl.static_range(NB):
                w = warpgroup_mma(aT, kw_s.index(j), zero, is_async=True)
                w, aT = warpgroup_mma_wait(0, deps=[w, aT])
                # lint: allow TP001 -- W's rows leave from the accumulator layout; a varlen tail's rows belong to the next sequence (masked)
                gl.store(w_ptr + orows * K + (j * CW + co)[None, :], w.to(w_ptr.dtype.element_ty), mask=o_ok)
            for j in gl.static_range(NBV):
                u = warpgroup_mma(aT, v_s.index(j), zero, is_async=True)
                u, aT = warpgroup_mma_wait(0, deps=[u, aT])
                # lint: allow TP001 -- as W
                gl.store(u_ptr + orows * V + (j * CW + co)[None, :], u.to(u_ptr.dtype.element_ty), mask=o_ok)
            if STORE_T:
                # lint: allow TP001 -- as W (T fp32, row t of its chunk at [t, hh, :])
                gl.store(t_ptr + ((bos + rs).to(gl.int64) * H + hh)[:, None] * BT + cs[None, :], Tm,
                         mask=r_ok[:, None])
        mbarrier.invalidate(bar)


# --------------------------------------------------------------------------------------------
# Stage 7 (dVl = scale P^T dO) of the unflagged chunks on TMA and tf32 WGMMA
# --------------------------------------------------------------------------------------------
# Which kernel takes stage 7's unflagged chunks in the gluon backend's backward: "triton"
# (`_kda_dv_local_kernel`'s whole-chunk route, CHUNKS "whole") or "gluon"
# (`_kda_dv_local_wgmma_kernel`; Triton's kernel then takes the flagged chunks only). Read at each
# call. "gluon" since the H200 timed it (kda_ab "dv-local-gluon" at 35f9352, S1, one process, same
# inputs): stage 7 0.60 -> 0.31 ms per backward, the backward from kept tiles 5.412 -> 5.109 ms,
# gradients 6e-5 (normwise) from Triton's (tf32 products in another order); ~0.22 ms is the stage's
# bytes (q, k, dO in bf16, G and dVl in fp32: 0.92 GB). bf16 inputs only; others stay on Triton's.
BACKWARD_DV_LOCAL = "gluon"

if _GLUON_ERROR is None:

    @gluon.jit
    def _kda_dv_local_wgmma_kernel(q_desc, k_desc, do_desc, G_ptr, dvl_ptr, chunks_ptr, flags_ptr, H, scale, eps,
                                   K: gl.constexpr, V: gl.constexpr, L2NORM_QK: gl.constexpr):
        """Stage 7 for one chunk and head whose flag (stage 3's, int8 [NC, H]) is clear: what Triton's
        `_kda_dv_local_chunk` computes for it at PREC "tf32",
            P^T = upper((K^ e^-d) (Q^ e^d)^T) [s, t] (s <= t, both rows in the sequence),
            dVl = scale P^T dO   (fp32 [Ntok, H, V]),
        with d = G - G_m (m the chunk's middle row; |d| <= 60 where the flag is clear) and, with
        L2NORM_QK, Q^ and K^ the raw rows normalised here in fp32 (x rsqrt(sum x^2 + eps)), else q and
        k as given. Grid (NC, H), 4 warps (one warpgroup); a flagged chunk's program returns
        (Triton's kernel takes it). Both products tf32 WGMMAs on fp32 operands, as Triton's tl.dot
        at tf32 multiplies (truncated, m64nNk8).
        Explicit here (Triton would choose): q, k and dO (16-bit) come by TMA on one mbarrier while
        the gates load into registers; K^ e^-d is P^T's register A operand, Q^ e^d goes to shared
        memory row-major (the K-major B operand as a transposed view), dO widened to fp32 and
        written transposed (tokens contiguous: the K-major B operand of the second product, which
        contracts over tokens; TMA cannot transpose); P^T masked in registers becomes the second
        product's register A operand. 112 KB of shared memory at K = V = 128: two programs an SM.
        Rows past the sequence (a varlen tail: TMA gives the next sequence's rows) are zeroed as
        they leave the TMA tiles, and dVl's rows are stored with a row mask."""
        BT: gl.constexpr = q_desc.block_type.shape[0]
        NW: gl.constexpr = gl.num_warps()
        gl.static_assert(NW == 4, "one warpgroup: P^T's rows and dVl's in one accumulator layout each")
        c = gl.program_id(0)
        hh = gl.program_id(1)
        ROWS_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])  # [64, K] and [64, V] rows
        P_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 8])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, V, 8])
        XQ_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, K], gl.float32)
        DOT_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([V, BT], gl.float32)
        q_s = gl.allocate_shared_memory(q_desc.dtype, [BT, K], q_desc.layout)
        k_s = gl.allocate_shared_memory(k_desc.dtype, [BT, K], k_desc.layout)
        do_s = gl.allocate_shared_memory(do_desc.dtype, [BT, V], do_desc.layout)
        xq_s = gl.allocate_shared_memory(gl.float32, [BT, K], XQ_SL)  # Q^ e^d, row-major
        doT_s = gl.allocate_shared_memory(gl.float32, [V, BT], DOT_SL)  # dO^T, tokens contiguous
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        if gl.load(flags_ptr + c * H + hh) == 0:
            bos, eos = _chunk_bounds(chunks_ptr, c)
            mbarrier.init(bar, count=1)
            fence_async_shared()
            mbarrier.expect(bar, q_desc.block_type.nbytes + k_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [bos, hh * K], bar, q_s)
            tma.async_copy_global_to_shared(k_desc, [bos, hh * K], bar, k_s)
            tma.async_copy_global_to_shared(do_desc, [bos, hh * V], bar, do_s)
            # the gates under the loads: d = G - G_m on the chunk's rows, 0 past the sequence
            r = gl.arange(0, BT, layout=gl.SliceLayout(1, ROWS_L))
            kc = gl.arange(0, K, layout=gl.SliceLayout(0, ROWS_L))
            valid = (bos + r < eos)[:, None]
            m = bos + (gl.minimum(eos - bos, BT) - 1) // 2  # the middle row as `_chunk_gate_offsets` takes it
            Gm = gl.load(G_ptr + (m.to(gl.int64) * H + hh) * K + kc)
            # lint: allow TP001 -- G's rows, masked past the sequence, meet Q and K in registers (fp32 G: no TMA tile is used as loaded)
            Gt = gl.load(G_ptr + ((bos + r).to(gl.int64) * H + hh)[:, None] * K + kc[None, :], mask=valid, other=0.0)
            d = gl.where(valid, (Gt - Gm[None, :]).to(gl.float32), 0.0)
            mbarrier.wait(bar, 0)
            q = gl.where(valid, q_s.load(ROWS_L).to(gl.float32), 0.0)
            if L2NORM_QK:
                q = q * gl.rsqrt(gl.sum(q * q, axis=1) + eps)[:, None]
            xq_s.store(q * gl.exp(d))
            k = gl.where(valid, k_s.load(ROWS_L).to(gl.float32), 0.0)
            if L2NORM_QK:
                k = k * gl.rsqrt(gl.sum(k * k, axis=1) + eps)[:, None]
            a_ks = gl.convert_layout(k * gl.exp(-d), gl.DotOperandLayout(operand_index=0, parent=P_L, k_width=1))
            doT_s.store(gl.permute(gl.where(valid, do_s.load(ROWS_L).to(gl.float32), 0.0), (1, 0)))
            fence_async_shared()
            gl.thread_barrier()  # every warp's part of Q^ e^d and dO^T, before the WGMMAs read them
            pt = warpgroup_mma(a_ks, xq_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, P_L), is_async=True)
            pt, _a, _x = warpgroup_mma_wait(0, deps=[pt, a_ks, xq_s])
            rs = gl.arange(0, BT, layout=gl.SliceLayout(1, P_L))
            ts = gl.arange(0, BT, layout=gl.SliceLayout(0, P_L))
            keep = (rs[:, None] <= ts[None, :]) & (bos + rs < eos)[:, None] & (bos + ts < eos)[None, :]
            a_pt = gl.convert_layout(gl.where(keep, pt, 0.0), gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=1))
            dvl = warpgroup_mma(a_pt, doT_s.permute((1, 0)), gl.zeros([BT, V], gl.float32, O_L), is_async=True)
            dvl, _p, _d = warpgroup_mma_wait(0, deps=[dvl, a_pt, doT_s])
            ro = gl.arange(0, BT, layout=gl.SliceLayout(1, O_L))
            co = gl.arange(0, V, layout=gl.SliceLayout(0, O_L))
            offs = ((bos + ro).to(gl.int64) * H + hh)[:, None] * V + co[None, :]
            # lint: allow TP001 -- a varlen chunk's tail rows belong to the next sequence: a 64-row TMA store would overwrite them; the masked store writes only this chunk's rows
            gl.store(dvl_ptr + offs, dvl * scale, mask=(bos + ro < eos)[:, None])
            mbarrier.invalidate(bar)


def dv_local_kernel_for(q, k, G, do, input_dtype: torch.dtype, span_flags) -> str:
    """"gluon" or "triton": which kernel takes stage 7's unflagged chunks (BACKWARD_DV_LOCAL,
    validated here): the Gluon kernel where Triton's would multiply in tf32 (`_products` for the
    input dtype), on bf16 q, k (raw, with or without the in-kernel normalisation) and dO (the
    descriptors' shared layouts exist for bf16 and fp32 only, and the gluon backend takes bf16),
    per channel gates G in fp32, K and V of HEAD_DIMS, stage 3's int8 flags given, every tensor
    contiguous, 16-byte aligned (TMA) and on the GPU."""
    if kk._checked("BACKWARD_DV_LOCAL", BACKWARD_DV_LOCAL, _KERNEL_CHOICES) == "triton" or _GLUON_ERROR is not None:
        return "triton"
    if span_flags is None or span_flags.dtype != torch.int8:
        return "triton"
    K, V = q.shape[-1], do.shape[-1]
    bf = torch.bfloat16
    dtypes = q.dtype == bf and k.dtype == bf and do.dtype == bf and G.dtype == torch.float32
    shapes = K in HEAD_DIMS and V in HEAD_DIMS and k.shape == q.shape == G.shape
    placed = all(x.is_cuda and x.is_contiguous() and x.data_ptr() % 16 == 0 for x in (q, k, G, do))
    tf32 = kk._products(input_dtype, True)[2].removesuffix("-emulated") == "tf32"
    return "gluon" if dtypes and shapes and placed and tf32 else "triton"


def chunk_dv_local_kda_gluon(q, k, G, do, scale: float, plan, input_dtype: torch.dtype, span_flags=None,
                             worklist=None, raw_qk=None):
    """Stage 7 (`triton_kernels.chunk_dv_local_kda`'s contract): the unflagged chunks on
    `_kda_dv_local_wgmma_kernel` where `dv_local_kernel_for` takes their operands (raw_qk's 16-bit
    q and k, normalised in the kernel, or q and k as given when they are 16-bit), then the flagged
    ones on Triton's kernel into the same buffer; Triton's stage 7 whole otherwise."""
    qk = raw_qk if raw_qk is not None else (q, k)
    if dv_local_kernel_for(*qk, G, do, input_dtype, span_flags) == "triton":
        return kk.chunk_dv_local_kda(q, k, G, do, scale, plan, input_dtype, span_flags=span_flags,
                                     worklist=worklist, raw_qk=raw_qk)
    Ntok, H, K = q.shape
    V = do.shape[-1]
    dvl = new_empty((Ntok, H, V), torch.float32, q.device)
    if plan.NC:
        qd, kd = (_descriptor(x.view(Ntok, H * K), [BT, K]) for x in qk)
        _kda_dv_local_wgmma_kernel[(plan.NC, H)](qd, kd, _descriptor(do.view(Ntok, H * V), [BT, V]), G, dvl,
                                                 plan.chunks, span_flags, H, float(scale), kk.L2NORM_EPS, K, V,
                                                 raw_qk is not None, num_warps=4)
    return kk.chunk_dv_local_kda(q, k, G, do, scale, plan, input_dtype, span_flags=span_flags, worklist=worklist,
                                 raw_qk=raw_qk, dvl=dvl)


def _dv_local_compile_cases():
    """`_kda_dv_local_wgmma_kernel` at K = V = 128 and 64, bf16 q, k and dO, with and without the
    in-kernel normalisation."""
    from tileport.compile_check import CompileCase, TensorStandIn, descriptor_stand_in

    cases = []
    Ntok, H, NC = 32768, 16, 512
    bf = torch.bfloat16
    for K, l2 in ((128, True), (128, False), (64, True)):
        V = K

        def desc(D):
            return descriptor_stand_in([Ntok, H * D], bf, [BT, D], _smem_layout((BT, D), bf))

        args = dict(q_desc=desc(K), k_desc=desc(K), do_desc=desc(V), G_ptr=TensorStandIn([Ntok, H, K], torch.float32),
                    dvl_ptr=TensorStandIn([Ntok, H, V], torch.float32), chunks_ptr=TensorStandIn([2 * NC], torch.int32),
                    flags_ptr=TensorStandIn([NC, H], torch.int8), H=H, scale=0.1, eps=1e-6, K=K, V=V, L2NORM_QK=l2)
        cases.append(CompileCase(name=f"kda_dv_local_K{K}_V{V}{'_l2' if l2 else ''}", kernel=_kda_dv_local_wgmma_kernel,
                                 args=args, num_warps=4,
                                 expect_ptx=["wgmma.mma_async", "tf32.tf32", "cp.async.bulk.tensor", "mbarrier.try_wait"],
                                 expect_max_spills=0, expect_max_shared=SMEM_PER_SM // 2))
    return cases


# --------------------------------------------------------------------------------------------
# Stage 10 (back through W, U, T and A, with 10b's pair terms) on TMA and tf32 WGMMA
# --------------------------------------------------------------------------------------------
# Which kernel takes stage 10's unflagged chunks in the gluon backend's backward: "triton"
# (`_kda_wy_bwd_kernel` with PAIRS, every chunk) or "gluon" (the unflagged chunks on Gluon, in
# WY_FORM's form, Triton's kernel the flagged ones). Read at each call. "gluon" since the H200
# gated it (tests/test_kda_gluon_wy.py at 3c5dbb3 and dada13b, the whole KDA gate at e3efcbc)
# and timed it (kda_ab.py "wy" at dada13b, S1, from
# kept tiles, one run): the kernel 2.31 ms per backward against Triton's 2.49, the backward 7.957 ->
# 7.812 ms with logsigmoid gates; with steep gates (every chunk flagged) 22.33 -> 22.38 (the
# launch whose programs all return). ncu: 1.13 TB/s, 12.9% issue slots busy, one CTA of 8 warps per
# SM (255 registers, 213 KB), 87% of cycles with no eligible warp: latency-bound (docs/perf/kda.md row 20).
BACKWARD_WY = "gluon"
_KERNEL_CHOICES = ("triton", "gluon")
CB = 64  # key (and value) channels per block: every tile of the stage-10 kernel is [64, 64] fp32
# How stage 10's unflagged chunks run on Gluon: "one-kernel" (`_kda_wy_bwd_wgmma_kernel`: both
# phases in one program of 8 warps, 213 KB, one an SM) or "split" (`_kda_wy_dA_kernel` for dA, dV
# and M, then `_kda_wy_pairs_kernel` for the pair terms, dk, dg, dbeta: 4 warps and <= 80 KB each,
# M, M^T and dXw through global memory, 268 MB each at S1). Read at each call. "split" since the
# eighteenth session (docs/perf/kda.md row 23): the gate's gluon-backend files passed with it on the
# H200 (52 passed), memcheck and racecheck clean, kda_ab "wy-split" at 32fbcd8 (S1, kept tiles):
# the backward 6.860 -> 6.699 ms, stage 10 2.32 -> 2.15 ms (0.61 + 1.54).
WY_FORM = "split"
# The split form's pairs kernel works by blocks of 32 key channels, a block's loads issued together.
# At 64 channels those loads spill (352 B at K = 128; the backward 7.099 ms against 6.699 at S1,
# kda_ab at 32fbcd8), and issued one after the other they left the kernel latency-bound (1.72 ms
# per backward against 1.54; docs/perf/kda.md row 23). Fixed: the compile cases and tests run 32.
_PAIRS_CHANNELS = 32
# How the pairs kernel gets a block's G, dXw, dK', K and dG' tiles: "tma" (TMA into shared slots,
# the next block's under this one's work; TMA_TILES) or "loads" (pointer loads at the block's start,
# the form timed at 32fbcd8). Read at each call (kda_ab "pairs-tiles").
PAIRS_TILES = "tma"
# Where the pairs kernel forms its transposed gated keys from: "accumulator" (KEYS_FROM_ACC: the
# block's K and G in the accumulator layout, read once, e^d and e^-d formed once) or "rows" (K and
# G read again in a row layout, the form timed at e48d059). Read at each call (kda_ab
# "pairs-keys"). "accumulator" since the H200 timed it (at 35f9352, S1): the pairs kernel 1.229 ->
# 1.146 ms, the backward 5.392 -> 5.302 ms, gradients bitwise equal to the "rows" form's.
PAIRS_GATED_KEYS = "accumulator"
# How the dA kernel gets a block's dVn and dW tiles: "tma" (TMA into staging slots, the next
# block's under this one's work; TMA_TILES) or "loads" (pointer loads transposed into shared
# memory at the block's start, the form timed at e48d059). Read at each call (kda_ab "dA-tiles").
DA_TILES = "tma"


def _pairs_tma_fits(*tensors) -> bool:
    """Whether the pairs kernel's tiles can come by TMA: contiguous fp32 or bf16 tensors on
    16-byte aligned storage (their [Ntok, H K] rows are then 16-byte multiples at K of HEAD_DIMS)."""
    return all(x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16) and x.data_ptr() % 16 == 0
               for x in tensors)

if _GLUON_ERROR is None:

    @gluon.jit
    def _chunk_rows(bos, eos, hh, H, BT: gl.constexpr, NCOL: gl.constexpr, L: gl.constexpr):
        """Indices of a [BT, NCOL] tile of the chunk starting at token bos, in layout L: the row and
        column aranges, which rows are inside the sequence (before eos) and those rows' offsets
        (int64, tokens x H + hh) in a [Ntok, H, *] tensor, the last two [BT]."""
        r = gl.arange(0, BT, layout=gl.SliceLayout(1, L))
        c = gl.arange(0, NCOL, layout=gl.SliceLayout(0, L))
        return r, c, bos + r < eos, (bos + r).to(gl.int64) * H + hh

    @gluon.jit
    def _dxu_dxw_block(a_tT, dvnT_b, dwT_b, zero, v_ptr, dv_ptr, beta, orows, o_ok, col0, V: gl.constexpr):
        """Stage 10's first products for one block of 64 value/key channels (from column col0):
        dXu_b = T^T dVn_b and dXw_b = T^T dW_b (tf32 WGMMAs, T^T a register or shared A operand, dVn_b^T and
        dW_b^T in shared memory), with dV_b = diag(beta) dXu_b stored (rows past the sequence
        masked); returns (dXu_b, dXw_b, rowsum(V_b dXu_b), V_b in fp32). Both stage-10 forms call it."""
        NW: gl.constexpr = gl.num_warps()
        CB: gl.constexpr = dvnT_b.shape[0]
        dxu = warpgroup_mma(a_tT, dvnT_b.permute((1, 0)), zero, is_async=True)
        dxw = warpgroup_mma(a_tT, dwT_b.permute((1, 0)), zero, is_async=True)
        # V's rows loaded under the products (one global round trip fewer on the chain)
        voffs = orows[:, None] * V + (col0 + gl.arange(0, CB, layout=gl.SliceLayout(0, zero.type.layout)))[None, :]
        # lint: allow TP001 -- dV and V's rows in the accumulator layout they are combined in (TMA would add a shared-memory round trip); a varlen tail's rows masked
        vt = gl.load(v_ptr + voffs, mask=o_ok[:, None], other=0.0).to(gl.float32)
        dxu, dxw, _t, _x, _w = warpgroup_mma_wait(0, deps=[dxu, dxw, a_tT, dvnT_b, dwT_b])
        if NW > 4:
            # the caller's layout conversions go through shared-memory scratch, which may take a
            # buffer this warpgroup is done with while the other still reads it (triton 11047)
            gl.thread_barrier()
        # lint: allow TP001 -- as V
        gl.store(dv_ptr + voffs, (dxu * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=o_ok[:, None])
        return dxu, dxw, gl.sum(vt * dxu, axis=1), vt

    @gluon.jit
    def _kda_wy_bwd_wgmma_kernel(u_desc, w_desc, t_ptr, dw_ptr, dvn_ptr, k_ptr, v_ptr, beta_ptr, G_ptr, dkp_ptr,
                                 dGp_ptr, dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, chunks_ptr, flags_ptr, H,
                                 K: gl.constexpr, V: gl.constexpr):
        """10 and 10b for one chunk and head whose flag (stage 3's, int8 [NC, H]) is clear, as
        Triton's `_kda_wy_bwd_kernel` with PAIRS computes it for such a chunk; grid (NC, H), 8 warps
        (two warpgroups side by side along N); a flagged chunk's program returns (Triton's kernel
        takes it, CHUNKS "flagged"). Every product a tf32 WGMMA on fp32 [64, 64] operands, by
        blocks b of 64 channels (K == V, so block b of the keys and of the values pair up):
            dXu_b = T^T dVn_b,  dXw_b = T^T dW_b,  dA = -sum_b (dXu_b U_b^T + dXw_b W_b^T)
            dV_b = diag(beta) dXu_b,  M = strict_lower(dA) on the chunk's rows
        then with d = G - G_m (m the chunk's middle row, |d| <= 60 where the chunk is unflagged):
            R_b = e^d (M (K_b e^-d)) + exp(G) dXw_b,  C_b = e^-d (M^T (diag(beta) K_b e^d))
            dk_b = dK'_b + diag(beta) R_b + C_b,  dG_b = dG'_b + diag(beta) K_b R_b - K_b C_b
            dg_b = dG_b summed in reverse over the chunk,  dbeta = rowsum(V dXu) + rowsum(K R)
        (dK', dG': stage 9's fp32 partials). dA never leaves the program (only flagged chunks'
        dA is read, by 10b's block launch).
        Explicit here (Triton would choose): tf32 WGMMA reads both operands K-major, so U_b and
        W_b come by TMA as stored (the B operands of dA's products, contracting over channels);
        T^T, dXu_b and dXw_b are register A operands (T^T loaded transposed); M and M^T are
        stored to shared memory as A operands (M^T a register transpose on its way there, where
        Triton's kernel must store dA and load it back; both in registers spilled 88 B per thread
        at K = 128); dVn_b, dW_b and the gated K_b e^-d and diag(beta) K_b e^d, which contract
        over the chunk's tokens, are written to shared memory transposed. dXw_b is formed twice (for dA, then for
        R_b), which costs one [64, 64] product and keeps no [64, K] tile live across the two
        phases. Rows past the chunk's sequence (a varlen tail: the TMA rows of the next sequence,
        finite) meet only masked factors: T's, dVn's, dW's and K's rows are loaded masked and
        M's rows and columns by the strict-lower mask; every store is row-masked.
        (A form with dVn, dW, dK' and dG' staged by TMA at the program's start ran no faster on the
        H200, 2.318 ms per backward either way at S1: docs/perf/kda.md row 22.)"""
        BT: gl.constexpr = u_desc.block_type.shape[0]
        CB: gl.constexpr = u_desc.block_type.shape[1]
        gl.static_assert(K == V and K % CB == 0, "the blocks of K and V pair up")
        gl.static_assert(CB == BT, "one column index serves T's rows and a block's")
        NB: gl.constexpr = K // CB
        NW: gl.constexpr = gl.num_warps()
        WG: gl.constexpr = NW // 4
        c = gl.program_id(0)
        hh = gl.program_id(1)
        A_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, CB // WG, 8])  # every tile is [64, 64]
        OP_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=A_L, k_width=1)
        ROWS_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
        # dg's scan over the chunk's rows: each column's 64 rows inside one warp (triton 3.6 lowers no
        # scan over the WGMMA layout)
        SCAN_L: gl.constexpr = gl.BlockedLayout([BT // 32, 1], [32, 1], [1, NW], [0, 1])
        XT_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CB, BT], gl.float32)
        u_s = gl.allocate_shared_memory(gl.float32, [NB, BT, CB], u_desc.layout)
        w_s = gl.allocate_shared_memory(gl.float32, [NB, BT, CB], w_desc.layout)
        dvnT_s = gl.allocate_shared_memory(gl.float32, [NB, CB, BT], XT_SL)
        dwT_s = gl.allocate_shared_memory(gl.float32, [NB, CB, BT], XT_SL)
        xT_s = gl.allocate_shared_memory(gl.float32, [CB, BT], XT_SL)  # (K_b e^-d)^T
        yT_s = gl.allocate_shared_memory(gl.float32, [CB, BT], XT_SL)  # (diag(beta) K_b e^d)^T
        m_s = gl.allocate_shared_memory(gl.float32, [2, BT, BT], XT_SL)  # M and M^T, A operands of R and C
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        if gl.load(flags_ptr + c * H + hh) == 0:
            bos, eos = _chunk_bounds(chunks_ptr, c)
            mbarrier.init(bar, count=1)
            fence_async_shared()
            mbarrier.expect(bar, NB * (u_desc.block_type.nbytes + w_desc.block_type.nbytes))
            for b in gl.static_range(NB):
                tma.async_copy_global_to_shared(u_desc, [bos, hh * V + b * CB], bar, u_s.index(b))
                tma.async_copy_global_to_shared(w_desc, [bos, hh * K + b * CB], bar, w_s.index(b))

            # under the TMA loads: T^T as a register operand (kept for both phases), dVn^T and dW^T
            rr, cc, r_ok, rows = _chunk_rows(bos, eos, hh, H, BT, CB, ROWS_L)
            r_ok, rows = r_ok[:, None], rows[:, None]
            a_tT = _transposed_rows(t_ptr, rows, r_ok, cc, A_L)
            for b in gl.static_range(NB):
                _store_transposed(dvnT_s.index(b), dvn_ptr, rows, b * CB + cc, r_ok, V)
                _store_transposed(dwT_s.index(b), dw_ptr, rows, b * CB + cc, r_ok, K)
            fence_async_shared()
            gl.thread_barrier()  # every warp's part of dVn^T and dW^T, before the WGMMAs read them

            ro, co, o_ok, orows = _chunk_rows(bos, eos, hh, H, BT, CB, A_L)
            beta = gl.load(beta_ptr + orows, mask=o_ok, other=0.0).to(gl.float32)
            zero = gl.zeros([BT, CB], gl.float32, A_L)
            mbarrier.wait(bar, 0)

            # phase 1: dA (and dV, rowsum(V dXu)) block by block
            dA = zero
            vdu = gl.zeros([BT], gl.float32, gl.SliceLayout(1, A_L))
            for b in gl.static_range(NB):
                dxu, dxw, vdu_b, _v = _dxu_dxw_block(a_tT, dvnT_s.index(b), dwT_s.index(b), zero, v_ptr, dv_ptr, beta,
                                                 orows, o_ok, b * CB, V)
                vdu += vdu_b
                a_dxu = gl.convert_layout(dxu, OP_L)
                a_dxw = gl.convert_layout(dxw, OP_L)
                dA = warpgroup_mma(a_dxu, u_s.index(b).permute((1, 0)), dA, is_async=True)
                dA = warpgroup_mma(a_dxw, w_s.index(b).permute((1, 0)), dA, is_async=True)
                dA, _a, _b, _u, _w2 = warpgroup_mma_wait(0, deps=[dA, a_dxu, a_dxw, u_s.index(b), w_s.index(b)])
                if NW > 4:
                    gl.thread_barrier()  # as above

            keep = (ro[:, None] > co[None, :]) & o_ok[:, None] & (bos + co < eos)[None, :]
            M = gl.where(keep, -dA, 0.0)
            m_s.index(0).store(M)
            m_s.index(1).store(gl.permute(M, (1, 0)))

            # phase 2: the pair terms and the final dk, dg by blocks of key channels
            m = bos + (gl.minimum(eos - bos, BT) - 1) // 2  # the middle row as `_chunk_gate_offsets` takes it
            betar = gl.load(beta_ptr + (bos + rr).to(gl.int64) * H + hh, mask=bos + rr < eos, other=0.0).to(gl.float32)
            kr = gl.zeros([BT], gl.float32, gl.SliceLayout(1, A_L))
            for b in gl.static_range(NB):
                # lint: allow TP001 -- K's and G's rows, masked past the sequence, are gated in registers on their way to shared memory transposed, which TMA cannot give
                kt = gl.load(k_ptr + rows * K + (b * CB + cc)[None, :], mask=r_ok, other=0.0).to(gl.float32)
                Gm = gl.load(G_ptr + (m.to(gl.int64) * H + hh) * K + b * CB + cc)
                # lint: allow TP001 -- as K's rows
                Gt = gl.load(G_ptr + rows * K + (b * CB + cc)[None, :], mask=r_ok, other=0.0)
                d = gl.where(r_ok, (Gt - Gm[None, :]).to(gl.float32), 0.0)
                xT_s.store(gl.permute(kt * gl.exp(-d), (1, 0)))
                yT_s.store(gl.permute(kt * betar[:, None] * gl.exp(d), (1, 0)))
                fence_async_shared()
                gl.thread_barrier()  # every warp's part of both (and of M, M^T), before the WGMMAs read them
                dxw = warpgroup_mma(a_tT, dwT_s.index(b).permute((1, 0)), zero, is_async=True)
                R = warpgroup_mma(m_s.index(0), xT_s.permute((1, 0)), zero, is_async=True)
                C = warpgroup_mma(m_s.index(1), yT_s.permute((1, 0)), zero, is_async=True)

                offs = orows[:, None] * K + (b * CB + co)[None, :]
                Gm2 = gl.load(G_ptr + (m.to(gl.int64) * H + hh) * K + b * CB + co)
                # lint: allow TP001 -- G, K and 9's partials in the accumulator layout they are combined in; a varlen tail's rows masked
                G2 = gl.load(G_ptr + offs, mask=o_ok[:, None], other=0.0)
                d2 = gl.where(o_ok[:, None], (G2 - Gm2[None, :]).to(gl.float32), 0.0)
                eg = gl.exp(gl.where(o_ok[:, None], G2.to(gl.float32), float("-inf")))
                # lint: allow TP001 -- as G
                k2 = gl.load(k_ptr + offs, mask=o_ok[:, None], other=0.0).to(gl.float32)
                # lint: allow TP001 -- as G
                dkp = gl.load(dkp_ptr + offs, mask=o_ok[:, None], other=0.0)
                dxw, R, C, _t2, _m, _mt, _dw, _x2, _y2 = warpgroup_mma_wait(
                    0, deps=[dxw, R, C, a_tT, m_s.index(0), m_s.index(1), dwT_s.index(b), xT_s, yT_s])
                if NW > 4:
                    gl.thread_barrier()  # every warpgroup is done with xT_s and yT_s before the next block's (triton 11047)
                R = R * gl.exp(d2) + eg * dxw
                C = C * gl.exp(-d2)
                dk = dkp + beta[:, None] * R + C
                # lint: allow TP001 -- as G (loaded here, not under the products: both partials there spilled)
                dG = gl.load(dGp_ptr + offs, mask=o_ok[:, None], other=0.0) + (beta[:, None] * R - C) * k2
                kr += gl.sum(k2 * R, axis=1)
                # lint: allow TP001 -- as G
                gl.store(dk_ptr + offs, dk.to(dk_ptr.dtype.element_ty), mask=o_ok[:, None])
                dg = gl.associative_scan(gl.convert_layout(dG, SCAN_L), 0, _sum_combine, reverse=True)
                rs = gl.arange(0, BT, layout=gl.SliceLayout(1, SCAN_L))
                cs = gl.arange(0, CB, layout=gl.SliceLayout(0, SCAN_L))
                # lint: allow TP001 -- dg's rows in the scan's layout; a varlen tail's rows masked
                gl.store(dg_ptr + ((bos + rs).to(gl.int64) * H + hh)[:, None] * K + (b * CB + cs)[None, :],
                         dg.to(dg_ptr.dtype.element_ty), mask=(bos + rs < eos)[:, None])
            gl.store(dbeta_ptr + orows, (vdu + kr).to(dbeta_ptr.dtype.element_ty), mask=o_ok)
            mbarrier.invalidate(bar)

    @gluon.jit
    def _kda_wy_dA_kernel(u_desc, w_desc, t_ptr, dw_ptr, dvn_ptr, v_ptr, beta_ptr, dv_ptr, vdu_ptr, dxw_ptr, mm_desc,
                          chunks_ptr, flags_ptr, H, K: gl.constexpr, V: gl.constexpr, U_FREE: gl.constexpr = False,
                          dvn_desc=None, dw_desc=None, TMA_TILES: gl.constexpr = False):
        """Stage 10's first half (WY_FORM "split") for one chunk and head whose flag is clear; grid
        (NC, H), 4 warps (one warpgroup), a flagged chunk's program returns. By blocks b of 64
        channels, in `_kda_wy_bwd_wgmma_kernel`'s order:
            dXu_b = T^T dVn_b,  dXw_b = T^T dW_b,  dA = -sum_b (dXu_b U_b^T + dXw_b W_b^T)
            dV_b = diag(beta) dXu_b,  vdu = rowsum(V dXu)   (vdu and dXw fp32, for the second half)
        then M = strict_lower(dA) on the chunk's rows, stored fp32 twice side by side, M and M^T
        (mm [NC * H * 64, 128] by TMA, row-major: the second half reads each as a K-major tf32 A
        operand, which a transposed view of one tile cannot be).
        Explicit here (Triton would choose): one block's U_b and W_b by TMA and its dVn_b, dW_b
        written transposed into one set of shared slots reused block after block (64 KB at any K,
        80 KB with the layout conversions' scratch; 242 registers at K = 128), so that two
        programs fit an SM (the one-kernel form holds every block and both phases' tiles, 213 KB:
        one program of 8 warps per SM, latency-bound); T^T, dXu_b and dXw_b are register A
        operands. H200 at 32fbcd8 (S1): 0.61 ms per backward, 63% of DRAM peak (ncu).
        U_FREE (triton_kernels.BACKWARD_U_FROM_T): U is never formed and u_desc is not read (any
        descriptor of its block shape, e.g. W's, stands in): dXu_b U_b^T = dXu_b (T Bv_b)^T, so the
        blocks' dXu_b Bv_b^T (Bv_b = diag(beta) V_b, the V_b `_dxu_dxw_block` loads for vdu, stored
        into U_b's slot) sum apart and T, row-major through the same slot, takes the sum at the end:
        dA = sum_b dXw_b W_b^T + (sum_b dXu_b Bv_b^T) T^T. T^T is then a shared A operand (16 KB, in
        place of the register conversion's scratch: shared memory as without U_FREE), not registers,
        which the second accumulator needs (sm_90a, K = 128: 251 registers, no spills).
        TMA_TILES (DA_TILES "tma"): a block's dVn_b and dW_b come by TMA (dvn_desc, dw_desc: [Ntok, H V]
        and [Ntok, H K] views, blocks [64, 64]) into two staging slots, and go from there to their
        transposed slots through registers; the next block's are issued once every warp has read the
        staging, so they land under this block's products and stores instead of being waited for at
        the block's start (the pointer form: ncu at e48d059, long_scoreboard 5.90 cycles per issued
        instruction). Rows past a varlen chunk (TMA gives the next sequence's) are zeroed on the way
        out of the staging, as the pointer form's masked loads. 32 KB more shared memory (112 KB at
        any K): still two programs an SM.
        dVn in bf16 (stage 8's, triton_kernels.BACKWARD_DSTATES_DTYPE "bf16") is widened on its way to
        its transposed slot in either form (its staging slot then bf16, 8 KB). W in bf16
        (triton_kernels.BACKWARD_W_DTYPE "bf16": w_desc 16-bit): W_b comes by TMA into a 16-bit
        staging slot (8 KB) and is widened into its fp32 slot 16 rows at a time after the block's
        transposed stores, before their barrier; the wait before the products stays as well (a
        completed phase passes at once: without it the schedule spilled 136-308 B at K = 128,
        sm_90a); under U_FREE the host's stand-in for U's descriptor is then an fp32 one."""
        BT: gl.constexpr = u_desc.block_type.shape[0]
        CB: gl.constexpr = u_desc.block_type.shape[1]
        gl.static_assert(K == V and K % CB == 0, "the blocks of K and V pair up")
        gl.static_assert(CB == BT, "one column index serves T's rows and a block's")
        NB: gl.constexpr = K // CB
        NW: gl.constexpr = gl.num_warps()
        gl.static_assert(NW == 4, "one warpgroup: no scratch shared between warpgroups (triton 11047)")
        c = gl.program_id(0)
        hh = gl.program_id(1)
        A_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, CB, 8])
        OP_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=A_L, k_width=1)
        ROWS_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
        XT_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CB, BT], gl.float32)
        u_s = gl.allocate_shared_memory(gl.float32, [BT, CB], u_desc.layout)
        W16: gl.constexpr = w_desc.dtype != gl.float32
        w_s = gl.allocate_shared_memory(gl.float32, [BT, CB], XT_SL)  # fp32 [64, 64]: the fp32 descriptors' layout
        if W16:
            w_dst = gl.allocate_shared_memory(w_desc.dtype, [BT, CB], w_desc.layout)  # W_b's 16-bit staging
        else:
            w_dst = w_s
        dvnT_s = gl.allocate_shared_memory(gl.float32, [CB, BT], XT_SL)
        dwT_s = gl.allocate_shared_memory(gl.float32, [CB, BT], XT_SL)
        if U_FREE:
            # T^T as a shared A operand (16 KB), not registers: the 32 registers a thread that dAu
            # takes (in registers T^T and dAu spilled at K = 128: 255 registers, 44 B)
            tT_s = gl.allocate_shared_memory(gl.float32, [BT, BT], XT_SL)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        if TMA_TILES:
            dvn_st = gl.allocate_shared_memory(dvn_desc.dtype, [BT, CB], dvn_desc.layout)  # bf16 or fp32 dVn
            dw_st = gl.allocate_shared_memory(gl.float32, [BT, CB], dw_desc.layout)
            tbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        if gl.load(flags_ptr + c * H + hh) == 0:
            bos, eos = _chunk_bounds(chunks_ptr, c)
            mbarrier.init(bar, count=1)
            if TMA_TILES:
                mbarrier.init(tbar, count=1)
            fence_async_shared()
            if TMA_TILES:
                _da_tiles_issue(dvn_desc, dw_desc, dvn_st, dw_st, tbar, bos, hh * V, hh * K)
            rr, cc, r_ok, rows = _chunk_rows(bos, eos, hh, H, BT, CB, ROWS_L)
            r_ok, rows = r_ok[:, None], rows[:, None]
            ro, co, o_ok, orows = _chunk_rows(bos, eos, hh, H, BT, CB, A_L)
            zero = gl.zeros([BT, CB], gl.float32, A_L)
            dA = zero
            dAu = zero  # U_FREE: sum_b dXu_b Bv_b^T, which T^T takes after the blocks
            vdu = gl.zeros([BT], gl.float32, gl.SliceLayout(1, A_L))
            for b in gl.static_range(NB):
                if U_FREE:
                    mbarrier.expect(bar, w_desc.block_type.nbytes)
                else:
                    mbarrier.expect(bar, u_desc.block_type.nbytes + w_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(u_desc, [bos, hh * V + b * CB], bar, u_s)
                tma.async_copy_global_to_shared(w_desc, [bos, hh * K + b * CB], bar, w_dst)
                if b == 0:
                    if U_FREE:
                        _store_transposed(tT_s, t_ptr, rows, cc, r_ok, BT)  # T's rows transposed: T^T, K-major
                    else:
                        a_tT = _transposed_rows(t_ptr, rows, r_ok, cc, A_L)  # under the first loads
                    beta = gl.load(beta_ptr + orows, mask=o_ok, other=0.0).to(gl.float32)
                if TMA_TILES:
                    mbarrier.wait(tbar, b % 2)
                    dvnT_s.store(gl.permute(gl.where(r_ok, dvn_st.load(ROWS_L).to(gl.float32), 0.0), (1, 0)))
                    dwT_s.store(gl.permute(gl.where(r_ok, dw_st.load(ROWS_L), 0.0), (1, 0)))
                else:
                    _store_transposed(dvnT_s, dvn_ptr, rows, b * CB + cc, r_ok, V)
                    _store_transposed(dwT_s, dw_ptr, rows, b * CB + cc, r_ok, K)
                if W16:  # W_b widened into its fp32 slot, 16 rows at a time
                    mbarrier.wait(bar, b % 2)
                    for r16 in gl.static_range(BT // 16):
                        w_s.slice(r16 * 16, 16).store(w_dst.slice(r16 * 16, 16).load(ROWS_L).to(gl.float32))
                fence_async_shared()
                gl.thread_barrier()  # every warp's part of dVn_b^T and dW_b^T (and W_b), before the WGMMAs read them
                if TMA_TILES and b + 1 < NB:  # the staging is read by every warp: the next block's tiles
                    _da_tiles_issue(dvn_desc, dw_desc, dvn_st, dw_st, tbar, bos, hh * V + (b + 1) * CB,
                                    hh * K + (b + 1) * CB)
                if U_FREE:
                    dxu, dxw, vdu_b, vt = _dxu_dxw_block(tT_s, dvnT_s, dwT_s, zero, v_ptr, dv_ptr, beta, orows, o_ok,
                                                         b * CB, V)
                else:
                    dxu, dxw, vdu_b, vt = _dxu_dxw_block(a_tT, dvnT_s, dwT_s, zero, v_ptr, dv_ptr, beta, orows, o_ok,
                                                         b * CB, V)
                vdu += vdu_b
                if U_FREE:
                    u_s.store(vt * beta[:, None])  # Bv_b, rows past the sequence 0 (V's masked load)
                    fence_async_shared()
                    gl.thread_barrier()  # every warp's rows of Bv_b before the WGMMA reads them
                # lint: allow TP001 -- as V (fp32 dXw_b for the second half's R_b, in the layout it is formed in)
                gl.store(dxw_ptr + orows[:, None] * K + (b * CB + co)[None, :], dxw, mask=o_ok[:, None])
                a_dxu = gl.convert_layout(dxu, OP_L)
                a_dxw = gl.convert_layout(dxw, OP_L)
                mbarrier.wait(bar, b % 2)  # (with W16 waited for already: a completed phase passes at once)
                if U_FREE:
                    dAu = warpgroup_mma(a_dxu, u_s.permute((1, 0)), dAu, is_async=True)
                    dA = warpgroup_mma(a_dxw, w_s.permute((1, 0)), dA, is_async=True)
                    dA, dAu, _a, _b, _u, _w2 = warpgroup_mma_wait(0, deps=[dA, dAu, a_dxu, a_dxw, u_s, w_s])
                else:
                    dA = warpgroup_mma(a_dxu, u_s.permute((1, 0)), dA, is_async=True)
                    dA = warpgroup_mma(a_dxw, w_s.permute((1, 0)), dA, is_async=True)
                    dA, _a, _b, _u, _w2 = warpgroup_mma_wait(0, deps=[dA, a_dxu, a_dxw, u_s, w_s])
                if b + 1 < NB:
                    gl.thread_barrier()  # every warp is done with this block's slots before the next block's writes
            if U_FREE:
                # lint: allow TP001 -- T's rows, masked past the sequence, into the free slot (as `_transposed_rows`)
                t_rows = gl.load(t_ptr + rows * BT + cc[None, :], mask=r_ok, other=0.0)
                gl.thread_barrier()  # every warp is done with the last block's Bv_b
                u_s.store(t_rows)
                fence_async_shared()
                gl.thread_barrier()
                a_dAu = gl.convert_layout(dAu, OP_L)
                dA = warpgroup_mma(a_dAu, u_s.permute((1, 0)), dA, is_async=True)  # + (sum_b dXu_b Bv_b^T) T^T
                dA, _d, _u = warpgroup_mma_wait(0, deps=[dA, a_dAu, u_s])
            keep = (ro[:, None] > co[None, :]) & o_ok[:, None] & (bos + co < eos)[None, :]
            M = gl.where(keep, -dA, 0.0)
            gl.store(vdu_ptr + orows, vdu, mask=o_ok)
            # M and M^T out by TMA through the last block's U and W slots (free once dA's products retired)
            gl.thread_barrier()
            u_s.store(M)
            w_s.store(gl.permute(M, (1, 0)))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(mm_desc, [(c * H + hh) * BT, 0], u_s)
            tma.async_copy_shared_to_global(mm_desc, [(c * H + hh) * BT, BT], w_s)
            tma.store_wait(0)
            mbarrier.invalidate(bar)
            if TMA_TILES:
                mbarrier.invalidate(tbar)

    @gluon.jit
    def _da_tiles_issue(dvn_desc, dw_desc, dvn_s, dw_s, bar, row, dvn_col, dw_col):
        """`_kda_wy_dA_kernel`'s TMA_TILES loads: one block's dVn_b and dW_b [64, 64] tiles at
        (row, dvn_col) and (row, dw_col) into their staging slots, armed on bar together."""
        mbarrier.expect(bar, dvn_desc.block_type.nbytes + dw_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(dvn_desc, [row, dvn_col], bar, dvn_s)
        tma.async_copy_global_to_shared(dw_desc, [row, dw_col], bar, dw_s)

    @gluon.jit
    def _kda_wy_pairs_kernel(m_desc, dxw_ptr, k_ptr, beta_ptr, G_ptr, dkp_ptr, dGp_ptr, vdu_ptr, dk_ptr,
                             dbeta_ptr, dg_ptr, chunks_ptr, flags_ptr, H, K: gl.constexpr, CW: gl.constexpr,
                             g_desc=None, dxw_desc=None, dkp_desc=None, k_desc=None, dgp_desc=None,
                             TMA_TILES: gl.constexpr = False, KEYS_FROM_ACC: gl.constexpr = False):
        """Stage 10's second half (WY_FORM "split"): 10b's pair terms and the final dk, dg and dbeta
        for one chunk and head whose flag is clear, from M and M^T (`_kda_wy_dA_kernel`'s, by TMA);
        grid (NC, H), 4 warps, a flagged chunk's program returns. By blocks b of CW key channels
        (_PAIRS_CHANNELS), with d = G - G_m (m the chunk's middle row), as
        `_kda_wy_bwd_wgmma_kernel` forms them (but dbeta's row sums re-associated by CW channels):
            R_b = e^d (M (K_b e^-d)) + exp(G) dXw_b,  C_b = e^-d (M^T (diag(beta) K_b e^d))
            dk_b = dK'_b + diag(beta) R_b + C_b,  dG_b = dG'_b + diag(beta) K_b R_b - K_b C_b
            dg_b = dG_b summed in reverse over the chunk,  dbeta = vdu + sum_b rowsum(K_b R_b)
        (dXw_b: the first half's, read back instead of formed again from T and dW: fewer bytes, and
        no T^T in registers.)
        Explicit here (Triton would choose): M and M^T come by TMA as shared A operands; the gated
        keys, which contract over the chunk's tokens, are written to one set of shared slots
        transposed, reused block after block (56 KB, 242 registers at K = 128: 2 programs an SM); G,
        K, dXw and stage 9's partials of a block are loaded in the accumulator layout at the
        block's start, all together, so that their latencies overlap the keys' gating and the
        products instead of following each other (at 64 channels loaded one after the other, ncu:
        88% of cycles with no eligible warp, 22.7% of DRAM bandwidth, 1.72 ms per backward at S1;
        this form 1.54); 32-channel blocks leave the registers for that.
        TMA_TILES (PAIRS_TILES "tma"): a block's G, dXw, dK', K and dG' tiles come by TMA into one
        set of shared slots (g_desc, dxw_desc, dkp_desc, k_desc, dgp_desc: [Ntok, H K] views,
        blocks [64, CW]), and once every warp has read them into registers (both layouts: the
        transposed gated keys from the same K and G tiles) the slots are refilled with the next
        block's, so the next block's loads are in flight under this block's products, scan and
        stores instead of after them (the pointer form's loads wait at each block's start: ncu at
        469bc98, 88% of cycles with no eligible warp). TMA's rows past a varlen chunk are the next
        sequence's (a flagged chunk's dXw rows unwritten): every tile is masked by row on its way
        out of shared memory. 40 KB more shared memory (fp32 keys), still two programs an SM.
        KEYS_FROM_ACC (PAIRS_GATED_KEYS "accumulator"): the transposed gated keys K_b e^-d and
        diag(beta) K_b e^d are formed from the block's K and G in the accumulator layout, the tiles
        the epilogue reads anyway, and their e^d, e^-d kept for R and C, instead of reading K and G
        a second time in a row layout and exponentiating twice (ncu at e48d059: the TMA form's
        leading stall, short_scoreboard 4.96 cycles per issued instruction, is its shared-memory
        reads). The same values in the same order: gradients bitwise."""
        BT: gl.constexpr = m_desc.block_type.shape[0]
        gl.static_assert(K % CW == 0, "whole blocks of key channels")
        NB: gl.constexpr = K // CW
        NW: gl.constexpr = gl.num_warps()
        gl.static_assert(NW == 4, "one warpgroup: no scratch shared between warpgroups (triton 11047)")
        c = gl.program_id(0)
        hh = gl.program_id(1)
        A_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, CW, 8])
        ROWS_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
        SCAN_L: gl.constexpr = gl.BlockedLayout([BT // 32, 1], [32, 1], [1, NW], [0, 1])
        XT_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CW, BT], gl.float32)
        m_s = gl.allocate_shared_memory(gl.float32, [2, BT, BT], m_desc.layout)  # M and M^T
        xT_s = gl.allocate_shared_memory(gl.float32, [CW, BT], XT_SL)  # (K_b e^-d)^T
        yT_s = gl.allocate_shared_memory(gl.float32, [CW, BT], XT_SL)  # (diag(beta) K_b e^d)^T
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        if TMA_TILES:
            g_s = gl.allocate_shared_memory(g_desc.dtype, [BT, CW], g_desc.layout)
            dxw_s = gl.allocate_shared_memory(dxw_desc.dtype, [BT, CW], dxw_desc.layout)
            dkp_s = gl.allocate_shared_memory(dkp_desc.dtype, [BT, CW], dkp_desc.layout)
            k_s = gl.allocate_shared_memory(k_desc.dtype, [BT, CW], k_desc.layout)
            dgp_s = gl.allocate_shared_memory(dgp_desc.dtype, [BT, CW], dgp_desc.layout)
            tbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        if gl.load(flags_ptr + c * H + hh) == 0:
            bos, eos = _chunk_bounds(chunks_ptr, c)
            mbarrier.init(bar, count=1)
            if TMA_TILES:
                mbarrier.init(tbar, count=1)
            fence_async_shared()
            tile = (c * H + hh) * BT
            mbarrier.expect(bar, 2 * m_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(m_desc, [tile, 0], bar, m_s.index(0))
            tma.async_copy_global_to_shared(m_desc, [tile, BT], bar, m_s.index(1))
            if TMA_TILES:
                _pairs_tiles_issue(g_desc, dxw_desc, dkp_desc, k_desc, dgp_desc, g_s, dxw_s, dkp_s, k_s, dgp_s, tbar,
                                   bos, hh * K)

            rr, cc, r_ok, rows = _chunk_rows(bos, eos, hh, H, BT, CW, ROWS_L)
            r_ok, rows = r_ok[:, None], rows[:, None]
            ro, co, o_ok, orows = _chunk_rows(bos, eos, hh, H, BT, CW, A_L)
            beta = gl.load(beta_ptr + orows, mask=o_ok, other=0.0).to(gl.float32)
            zero = gl.zeros([BT, CW], gl.float32, A_L)
            m = bos + (gl.minimum(eos - bos, BT) - 1) // 2  # the middle row as `_chunk_gate_offsets` takes it
            mrow = (m.to(gl.int64) * H + hh) * K
            if not KEYS_FROM_ACC:
                betar = gl.load(beta_ptr + (bos + rr).to(gl.int64) * H + hh, mask=bos + rr < eos,
                                other=0.0).to(gl.float32)
            kr = gl.zeros([BT], gl.float32, gl.SliceLayout(1, A_L))
            for b in range(NB):  # not unrolled: unrolled, the next block's loads rise into this one's and spill
                offs = orows[:, None] * K + (b * CW + co)[None, :]
                Gm2 = gl.load(G_ptr + mrow + b * CW + co)
                if not KEYS_FROM_ACC:
                    Gm = gl.load(G_ptr + mrow + b * CW + cc)
                if TMA_TILES:
                    mbarrier.wait(tbar, b & 1)
                    o_ok2 = o_ok[:, None]
                    G2 = gl.where(o_ok2, g_s.load(A_L), 0.0)
                    dxw = gl.where(o_ok2, dxw_s.load(A_L), 0.0)
                    dkp = gl.where(o_ok2, dkp_s.load(A_L), 0.0)
                    k2 = gl.where(o_ok2, k_s.load(A_L).to(gl.float32), 0.0)
                    dGp = gl.where(o_ok2, dgp_s.load(A_L), 0.0)
                    if not KEYS_FROM_ACC:
                        kt = gl.where(r_ok, k_s.load(ROWS_L).to(gl.float32), 0.0)
                        Gt = gl.where(r_ok, g_s.load(ROWS_L), 0.0)
                    gl.thread_barrier()  # every warp has read the slots before they take the next block's tiles
                    if b + 1 < NB:
                        _pairs_tiles_issue(g_desc, dxw_desc, dkp_desc, k_desc, dgp_desc, g_s, dxw_s, dkp_s, k_s,
                                           dgp_s, tbar, bos, hh * K + (b + 1) * CW)
                else:
                    # the block's tiles in the accumulator layout first, all in flight together
                    # lint: allow TP001 -- G, K, dXw and 9's partials in the accumulator layout they are combined in; a varlen tail's rows masked
                    G2 = gl.load(G_ptr + offs, mask=o_ok[:, None], other=0.0)
                    # lint: allow TP001 -- as G
                    dxw = gl.load(dxw_ptr + offs, mask=o_ok[:, None], other=0.0)
                    # lint: allow TP001 -- as G
                    dkp = gl.load(dkp_ptr + offs, mask=o_ok[:, None], other=0.0)
                    # lint: allow TP001 -- as G
                    k2 = gl.load(k_ptr + offs, mask=o_ok[:, None], other=0.0).to(gl.float32)
                    # lint: allow TP001 -- as G
                    dGp = gl.load(dGp_ptr + offs, mask=o_ok[:, None], other=0.0)
                    if not KEYS_FROM_ACC:
                        # lint: allow TP001 -- K's and G's rows, masked past the sequence, are gated in registers on their way to shared memory transposed, which TMA cannot give
                        kt = gl.load(k_ptr + rows * K + (b * CW + cc)[None, :], mask=r_ok, other=0.0).to(gl.float32)
                        # lint: allow TP001 -- as K's rows
                        Gt = gl.load(G_ptr + rows * K + (b * CW + cc)[None, :], mask=r_ok, other=0.0)
                if KEYS_FROM_ACC:
                    d2 = gl.where(o_ok[:, None], (G2 - Gm2[None, :]).to(gl.float32), 0.0)
                    ed2 = gl.exp(d2)
                    emd2 = gl.exp(-d2)
                    xT_s.store(gl.permute(k2 * emd2, (1, 0)))
                    yT_s.store(gl.permute(k2 * beta[:, None] * ed2, (1, 0)))
                else:
                    d = gl.where(r_ok, (Gt - Gm[None, :]).to(gl.float32), 0.0)
                    xT_s.store(gl.permute(kt * gl.exp(-d), (1, 0)))
                    yT_s.store(gl.permute(kt * betar[:, None] * gl.exp(d), (1, 0)))
                fence_async_shared()
                gl.thread_barrier()  # every warp's part of both tiles, before the WGMMAs read them
                mbarrier.wait(bar, 0)  # M and M^T (at once after the first block)
                R = warpgroup_mma(m_s.index(0), xT_s.permute((1, 0)), zero, is_async=True)
                C = warpgroup_mma(m_s.index(1), yT_s.permute((1, 0)), zero, is_async=True)
                R, C, _m, _mt, _x2, _y2 = warpgroup_mma_wait(0, deps=[R, C, m_s.index(0), m_s.index(1), xT_s, yT_s])
                if not KEYS_FROM_ACC:
                    d2 = gl.where(o_ok[:, None], (G2 - Gm2[None, :]).to(gl.float32), 0.0)
                    ed2 = gl.exp(d2)
                    emd2 = gl.exp(-d2)
                eg = gl.exp(gl.where(o_ok[:, None], G2.to(gl.float32), float("-inf")))
                R = R * ed2 + eg * dxw
                C = C * emd2
                dk = dkp + beta[:, None] * R + C
                # lint: allow TP001 -- as G
                gl.store(dk_ptr + offs, dk.to(dk_ptr.dtype.element_ty), mask=o_ok[:, None])
                kr += gl.sum(k2 * R, axis=1)
                dG = dGp + (beta[:, None] * R - C) * k2
                dg = gl.associative_scan(gl.convert_layout(dG, SCAN_L), 0, _sum_combine, reverse=True)
                rs = gl.arange(0, BT, layout=gl.SliceLayout(1, SCAN_L))
                cs = gl.arange(0, CW, layout=gl.SliceLayout(0, SCAN_L))
                # lint: allow TP001 -- dg's rows in the scan's layout; a varlen tail's rows masked
                gl.store(dg_ptr + ((bos + rs).to(gl.int64) * H + hh)[:, None] * K + (b * CW + cs)[None, :],
                         dg.to(dg_ptr.dtype.element_ty), mask=(bos + rs < eos)[:, None])
                gl.thread_barrier()  # every warp is done with this block's slots before the next block's writes
            vdu = gl.load(vdu_ptr + orows, mask=o_ok, other=0.0)
            gl.store(dbeta_ptr + orows, (vdu + kr).to(dbeta_ptr.dtype.element_ty), mask=o_ok)
            mbarrier.invalidate(bar)
            if TMA_TILES:
                mbarrier.invalidate(tbar)

    @gluon.jit
    def _pairs_tiles_issue(g_desc, dxw_desc, dkp_desc, k_desc, dgp_desc, g_s, dxw_s, dkp_s, k_s, dgp_s, bar, row, col):
        """`_kda_wy_pairs_kernel`'s TMA_TILES loads: one block's five [64, CW] tiles at (row, col)
        into their slots, armed on bar together."""
        mbarrier.expect(bar, g_desc.block_type.nbytes + dxw_desc.block_type.nbytes + dkp_desc.block_type.nbytes
                        + k_desc.block_type.nbytes + dgp_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(g_desc, [row, col], bar, g_s)
        tma.async_copy_global_to_shared(dxw_desc, [row, col], bar, dxw_s)
        tma.async_copy_global_to_shared(dkp_desc, [row, col], bar, dkp_s)
        tma.async_copy_global_to_shared(k_desc, [row, col], bar, k_s)
        tma.async_copy_global_to_shared(dgp_desc, [row, col], bar, dgp_s)


def wy_bwd_kernel_for(operands, G, input_dtype, span_flags, outputs_10b) -> str:
    """"gluon" or "triton": which kernel takes stage 10's unflagged chunks on these operands
    (k, v, then T, W, U, dW, dVn and stage 9's partials; BACKWARD_WY): the Gluon kernel where the
    products are tf32 (`kk._products`), every operand after k and v fp32 (k and v, like beta, are
    loaded into registers in any float dtype) but dVn, fp32 or bf16 (stage 8's in bf16:
    BACKWARD_DSTATES_DTYPE; widened on its way to shared memory), and W, fp32 or bf16 in the split
    form (BACKWARD_W_DTYPE; the dA kernel widens it), every operand and G contiguous (the kernel's row
    offsets assume it), G per channel in fp32, K == V of HEAD_DIMS, stage 3's int8 flags given and
    10b fused here (outputs_10b), on the GPU. U None (never formed: BACKWARD_U_FROM_T): the split
    form's U_FREE kernel only (WY_FORM "split")."""
    if kk._checked("BACKWARD_WY", BACKWARD_WY, _KERNEL_CHOICES) == "triton" or _GLUON_ERROR is not None:
        return "triton"
    if span_flags is None or span_flags.dtype != torch.int8 or outputs_10b is None or not G.is_cuda:
        return "triton"
    if operands[4] is None and kk._checked("WY_FORM", WY_FORM, ("one-kernel", "split")) != "split":
        return "triton"
    w, dvn = operands[3], operands[6]
    split = kk._checked("WY_FORM", WY_FORM, ("one-kernel", "split")) == "split"
    rest = [x for i, x in enumerate(operands) if i >= 2 and i not in (3, 6) and x is not None]  # T, U, dW, dK', dG'
    operands = tuple(x for x in operands if x is not None)
    k, v = operands[0], operands[1]
    K, V = k.shape[-1], v.shape[-1]
    tf32 = kk._products(input_dtype, True)[2].removesuffix("-emulated") == "tf32"
    fp32 = (all(x.dtype == torch.float32 for x in rest) and G.dtype == torch.float32 and G.dim() == 3
            and dvn.dtype in (torch.float32, torch.bfloat16)
            and (w.dtype == torch.float32 or split and w.dtype == torch.bfloat16))
    contiguous = all(x.is_contiguous() for x in operands) and G.is_contiguous()
    return "gluon" if tf32 and fp32 and contiguous and K == V and K in HEAD_DIMS else "triton"


def chunk_wy_bwd_kda_gluon(k, v, beta, G, Ai, w, u, dw, dvn, dk, dG, plan, dv_dtype: torch.dtype,
                           input_dtype: torch.dtype, span_flags=None, outputs_10b=None, worklist=None):
    """Stage 10 (`triton_kernels.chunk_wy_bwd_kda`'s contract, 10b's whole route fused as there,
    worklist the flagged chunks' as there):
    the chunks stage 3 left unflagged on Gluon where `wy_bwd_kernel_for` says so (WY_FORM:
    `_kda_wy_dA_kernel` then `_kda_wy_pairs_kernel`, or `_kda_wy_bwd_wgmma_kernel` alone), the
    flagged ones on Triton's kernel (only_flagged); Triton's for every chunk otherwise."""
    if wy_bwd_kernel_for((k, v, Ai, w, u, dw, dvn, dk, dG), G, input_dtype, span_flags, outputs_10b) == "triton":
        return kk.chunk_wy_bwd_kda(k, v, beta, G, Ai, w, u, dw, dvn, dk, dG, plan, dv_dtype, input_dtype,
                                   span_flags=span_flags, outputs_10b=outputs_10b, worklist=worklist)
    Ntok, H, K = k.shape
    V = v.shape[-1]
    dv = new_empty((Ntok, H, V), dv_dtype, k.device)
    if plan.NC:
        dk_out, dbeta_out, dg_out = outputs_10b
        def rows(t, D):
            return _descriptor(t.view(Ntok, H * D), [BT, CB])

        if kk._checked("WY_FORM", WY_FORM, ("one-kernel", "split")) == "split":
            vdu = new_empty((Ntok, H), torch.float32, k.device)
            mm = new_empty((plan.NC * H * BT, 2 * BT), torch.float32, k.device)  # M and M^T per chunk and head
            dxw = new_empty((Ntok, H, K), torch.float32, k.device)
            mm_desc = _descriptor(mm, [BT, BT])
            # U never formed (BACKWARD_U_FROM_T): an fp32 descriptor of U's block shape stands in for U's,
            # unread (U_FREE): W's, or dW's where W is bf16 (BACKWARD_W_DTYPE; U's slot is fp32)
            u_stand_in = rows(w if w.dtype == torch.float32 else dw, K)
            da_tiles = {}
            if kk._checked("DA_TILES", DA_TILES, ("tma", "loads")) == "tma" and _pairs_tma_fits(dvn, dw):
                da_tiles = dict(dvn_desc=rows(dvn, V), dw_desc=rows(dw, K), TMA_TILES=True)
            _kda_wy_dA_kernel[(plan.NC, H)](u_stand_in if u is None else rows(u, V), rows(w, K), Ai, dw, dvn, v, beta,
                                            dv, vdu, dxw, mm_desc, plan.chunks, span_flags, H, K, V,
                                            U_FREE=u is None, **da_tiles, num_warps=4)
            tiles = {}
            if kk._checked("PAIRS_TILES", PAIRS_TILES, ("tma", "loads")) == "tma" and _pairs_tma_fits(k, G, dxw, dk, dG):
                tiles = dict(zip(("g_desc", "dxw_desc", "dkp_desc", "k_desc", "dgp_desc"),
                                 (_descriptor(x.view(Ntok, H * K), [BT, _PAIRS_CHANNELS]) for x in (G, dxw, dk, k, dG))),
                             TMA_TILES=True)
            from_acc = kk._checked("PAIRS_GATED_KEYS", PAIRS_GATED_KEYS, ("accumulator", "rows")) == "accumulator"
            _kda_wy_pairs_kernel[(plan.NC, H)](mm_desc, dxw, k, beta, G, dk, dG, vdu, dk_out,
                                               dbeta_out, dg_out, plan.chunks, span_flags, H, K,
                                               _PAIRS_CHANNELS, **tiles, KEYS_FROM_ACC=from_acc, num_warps=4)
        else:
            _kda_wy_bwd_wgmma_kernel[(plan.NC, H)](
                rows(u, V), rows(w, K), Ai, dw, dvn, k, v, beta, G, dk, dG, dk_out, dv, dbeta_out, dg_out,
                plan.chunks, span_flags, H, K, V, num_warps=8)
    return kk.chunk_wy_bwd_kda(k, v, beta, G, Ai, w, u, dw, dvn, dk, dG, plan, dv_dtype, input_dtype,
                               span_flags=span_flags, outputs_10b=outputs_10b, only_flagged=True, dv=dv,
                               worklist=worklist)


def chunk_output_kda_gluon(q, k, G, h, vn, scale: float, plan, out_dtype: torch.dtype, span_flags=None):
    """Stage 6 (`triton_kernels.chunk_output_kda`'s contract): the unflagged chunks on the Gluon kernel,
    the flagged ones on Triton's block kernel; Triton's stage 6 whole where stage 3 made no flags
    (DIAGONAL_FORM other than "chunk") or the tiles are not all bf16."""
    if span_flags is None or any(x.dtype != torch.bfloat16 for x in (q, k, h, vn)):
        return kk.chunk_output_kda(q, k, G, h, vn, scale, plan, out_dtype, span_flags)
    Ntok, H, K = q.shape
    V = vn.shape[-1]
    o = new_empty((Ntok, H, V), out_dtype, q.device)
    if plan.NC:
        _kda_output_wgmma_kernel[(plan.NC, H)](*chunk_tile_descriptors(q, k, vn, h, plan), G, o, plan.chunks,
                                               span_flags, H, float(scale), K, V, num_warps=4)
        kk.output_flagged_chunks(q, k, G, h, vn, o, scale, plan, span_flags)
    return o


def solve_kernel_for(k, v, G, g, span_flags, compact: bool, keys_normalised: bool) -> str:
    """"gluon" or "triton": which kernel forms stage 3 of the forward on these operands
    (FORWARD_SOLVE): the Gluon kernel where Triton's tile kernel would run at the forward's
    precisions for normalised keys at their defaults (bf16 products, tf32 diagonal inverses, T by
    Horner: T_CHAIN), in the forward's form (compact: bf16 W and U; stage 2 inside stage 3: g
    given; G per channel in fp32; stage 3's int8 flags), on contiguous bf16 k and v with K == V of
    HEAD_DIMS and fp32 g (the H200 ran these; a bf16 g is compile-checked only), every TMA source
    16-byte aligned, on the GPU."""
    if kk._checked("FORWARD_SOLVE", FORWARD_SOLVE, _KERNEL_CHOICES) == "triton" or _GLUON_ERROR is not None:
        return "triton"
    if span_flags is None or g is None or not (compact and keys_normalised) or not G.is_cuda:
        return "triton"
    if (gdn_tk.NORMALISED_KEYS_PREC, gdn_tk.NORMALISED_KEYS_DIAG_PREC, gdn_tk._t_chain()) != ("bf16", "tf32", "horner"):
        return "triton"
    K, V = k.shape[-1], v.shape[-1]
    if K != V or K not in HEAD_DIMS or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        return "triton"
    if G.dtype != torch.float32 or G.dim() != 3 or not all(x.is_contiguous() for x in (k, v, G, g)):
        return "triton"
    if g.dtype != torch.float32 or any(x.data_ptr() % 16 for x in (g, k, v)):  # TMA descriptors' bases
        return "triton"
    return "gluon"


def chunk_solve_wu_kda_gluon(k, v, beta, G, plan, store_T: bool = False, compact: bool = False,
                             factored_diagonal: bool = False, keys_normalised: bool = False, g=None, span_flags=None,
                             with_wu: bool = True, l2norm_k: bool = False, kn_out=None,
                             t_dtype: torch.dtype = torch.float32, worklist_out=None):
    """Stage 3 of the forward (`triton_kernels.chunk_solve_wu`'s contract as KDA's forward calls
    it): (T [Ntok, H, 64] fp32 when store_T, else None; W; U). Where `solve_kernel_for` takes it,
    `_kda_solve_wgmma_kernel` forms G and the flags of every chunk and T, W and U of the unflagged
    ones, then Triton's block kernel the flagged ones (as after Triton's tile kernel); Triton's
    stage 3 whole otherwise, and always for T alone (with_wu False; the Gluon kernel forms W and U
    with T) or raw keys (l2norm_k, kn_out: Triton's tile kernel normalises and stores them);
    t_dtype (T alone only) and worklist_out as there."""
    triton_only = not with_wu or l2norm_k
    route = "triton" if triton_only else solve_kernel_for(k, v, G, g, span_flags, compact, keys_normalised)
    if route == "triton":  # through triton_kernels' name, which the tests' spies replace
        return kk.chunk_solve_wu(k, v, beta, G, plan, store_T=store_T, compact=compact,
                                 factored_diagonal=factored_diagonal, keys_normalised=keys_normalised, g=g,
                                 span_flags=span_flags, with_wu=with_wu, l2norm_k=l2norm_k, kn_out=kn_out,
                                 t_dtype=t_dtype, worklist_out=worklist_out)
    Ntok, H, K = k.shape
    V = v.shape[-1]
    if span_flags.shape != (plan.NC, H) or span_flags.dtype != torch.int8:
        raise ValueError(f"span_flags must be int8 [{plan.NC}, {H}], got {span_flags.dtype} {tuple(span_flags.shape)}")
    if g.shape != G.shape:
        raise ValueError(f"g must have G's shape {tuple(G.shape)}, got {tuple(g.shape)}")
    inter = gdn_tk._intermediate_dtype(k.dtype, compact)
    Ai = new_empty((Ntok, H, BT), torch.float32, k.device) if store_T else None
    w = new_empty((Ntok, H, K), inter, k.device)
    u = new_empty((Ntok, H, V), inter, k.device)
    if not plan.NC:
        return Ai, w, u
    beta = beta.contiguous()
    g_desc, k_desc, v_desc = (_descriptor(x.view(Ntok, -1), [BT, SOLVE_CW]) for x in (g, k, v))
    _kda_solve_wgmma_kernel[(plan.NC, H)](g_desc, k_desc, v_desc, beta, G, Ai if store_T else w, w, u, plan.chunks,
                                          span_flags, H, K, V, store_T, CHUNK_SPAN_MAX, num_warps=4)
    gdn_tk.solve_flagged_chunks(k, v, beta, G, Ai if store_T else w, w, u, plan, k.dtype, store_T, False,
                                factored_diagonal, span_flags, gdn_tk.flagged_worklist(span_flags, out=worklist_out))
    return Ai, w, u


# --------------------------------------------------------------------------------------------
# Stage 9 (dQ', dK', dW, dG' with 9b's pair terms) on TMA and tf32 WGMMA, for unflagged chunks.
# --------------------------------------------------------------------------------------------
# Which kernel takes stage 9's unflagged chunks in the gluon backend's backward: "triton"
# (`_kda_dqkwg_kernel` with PAIRS, every chunk) or "gluon" (`_kda_dqkwg_wgmma_kernel` the
# unflagged chunks, Triton's kernel the flagged ones, CHUNKS "flagged"). Read at each call.
# "gluon" since the H200 gated it (tests/test_kda_gluon_stage9.py and the whole KDA gate at
# e3efcbc) and timed it (kda_ab.py "dqkwg" at e3efcbc, S1, from kept tiles, one run): the kernel
# 1.39 ms per backward against Triton's 2.41, the backward 7.807 -> 6.862 ms with logsigmoid
# gates, 22.34 -> 22.29 with steep ones (docs/perf/kda.md row 21).
BACKWARD_DQKWG = "gluon"
DQKWG_BKS = 64  # key channels per block: every tile of the stage-9 kernel is [64, 64] fp32
# How `_kda_dqkwg_wgmma_kernel` gets dO and its epilogue's G, q and k tiles: "loads" (pointer loads:
# dO's before the state tiles' wait, G, q, k's after the products) or "tma" (TMA_TILES: all by TMA
# at the item's start, into slots the kernel only uses later, so nothing is read from global memory
# after the products but G's two rows). "tma" takes bf16 q and k and fp32 G on 16-byte aligned
# storage; "loads" otherwise. Read at each call. "tma" since the H200 timed both (kda_ab "dqkwg-tiles"
# at a84e724, S1, from kept tiles, one process, same inputs): the kernel 1.374 -> 1.207 ms, the
# backward 4.801 -> 4.632, gradients bitwise equal (kda.md row 46).
DQKWG_TILES = "tma"

if _GLUON_ERROR is None:

    @gluon.jit
    def _dqkwg_epilogue_tiles(q_ptr, k_ptr, G_ptr, bos, eos, hh, kb, H, K: gl.constexpr, BKS: gl.constexpr,
                              BT: gl.constexpr, D_L: gl.constexpr, g_s=None, q_s=None, k_s=None, tbar=None,
                              TMA_TILES: gl.constexpr = False):
        """Stage 9's epilogue's reads for key block kb of the chunk from token bos: G, q and k
        [BT, BKS] in the accumulator layout D_L (fp32, masked past the sequence), and G's last valid
        row (G_L) and middle row (`_chunk_gate_offsets`' m; eos is the sequence's end). Issued
        right after the state products, before the dW store, so that they are in flight while the
        accumulators are read. TMA_TILES: G, q and k from the shared slots their TMA loads (on
        tbar, issued at the item's start) filled, rows past the sequence set to 0 as the masked
        loads give them; then a CTA barrier, as the slots are the pair operands' next."""
        ro = gl.arange(0, BT, layout=gl.SliceLayout(1, D_L))
        kcol = kb * BKS + gl.arange(0, BKS, layout=gl.SliceLayout(0, D_L))
        base = (bos.to(gl.int64) * H + hh) * K
        offs = ro[:, None] * (H * K) + kcol[None, :]
        mk = (bos + ro < eos)[:, None] & (kcol < K)[None, :]
        last = gl.minimum(bos + BT, eos) - 1
        mid = bos + (gl.minimum(eos - bos, BT) - 1) // 2
        GL = gl.load(G_ptr + (last.to(gl.int64) * H + hh) * K + kcol)
        Gm = gl.load(G_ptr + (mid.to(gl.int64) * H + hh) * K + kcol)
        if TMA_TILES:
            mbarrier.wait(tbar, 0)
            G = gl.where(mk, g_s.load(D_L), 0.0)
            q = gl.where(mk, q_s.load(D_L).to(gl.float32), 0.0)
            k = gl.where(mk, k_s.load(D_L).to(gl.float32), 0.0)
            gl.thread_barrier()  # every warp has read the slots before the pair operands overwrite them
        else:
            # lint: allow TP001 -- G, q and k meet the accumulators in their layout, masked past the sequence (the TMA_TILES form takes them by TMA)
            G = gl.load(G_ptr + base + offs, mask=mk, other=0.0)
            # lint: allow TP001 -- as G
            q = gl.load(q_ptr + base + offs, mask=mk, other=0.0).to(gl.float32)
            # lint: allow TP001 -- as G
            k = gl.load(k_ptr + base + offs, mask=mk, other=0.0).to(gl.float32)
        return G, q, k, GL, Gm

    @gluon.jit
    def _kda_dqkwg_block(dqh, dkd, dwa, hdh, dd, G, q, k, GL, Gm, m_s, xT_s, yT_s, dq_ptr, dk_ptr, dw_ptr, dG_ptr,
                         bos, eos, hh, kb, H, scale, K: gl.constexpr, BKS: gl.constexpr):
        """Stage 9's epilogue for key block kb (columns kb * BKS ..) of an unflagged chunk: Triton's
        `_kda_dqkwg_kernel` with PAIRS after its V loop, for a chunk it takes whole, from the state
        products dQh = dO h^T, dKd = Vn dh^T, dwa = dVn h^T ([64, BKS] fp32, one accumulator
        layout), hdh = rowsum(h * dh) [BKS], dP's diagonal dd = scale dP_tt [64] and M =
        strict_lower(scale dP) in m_s, and `_dqkwg_epilogue_tiles`' G, q, k, G_L, G_m. The pair
        terms' operands go to shared memory transposed (K e^-d and Q e^d contract over the chunk's
        tokens, and tf32 WGMMA reads K-major only); M and M^T are register A operands made from m_s
        where used (M held in registers through the epilogue instead: 255 registers at sm_90a, K =
        V = 128, against 246: no room left)."""
        D_L: gl.constexpr = dqh.type.layout
        BT: gl.constexpr = dqh.shape[0]
        ro = gl.arange(0, BT, layout=gl.SliceLayout(1, D_L))
        kcol = kb * BKS + gl.arange(0, BKS, layout=gl.SliceLayout(0, D_L))
        tok = bos + ro
        valid = tok < eos
        # int32 offsets from the chunk's first row (64 rows of H * K: far below 2^31), the int64
        # part in the scalar base: an int64 [64, 64] offset tile is twice the registers
        base = (bos.to(gl.int64) * H + hh) * K
        offs = ro[:, None] * (H * K) + kcol[None, :]
        mk = valid[:, None] & (kcol < K)[None, :]
        # lint: allow TP001 -- dW leaves from its accumulator layout; a varlen tail's rows belong to the next sequence (masked)
        gl.store(dw_ptr + base + offs, -dwa, mask=mk)
        last = gl.minimum(bos + BT, eos) - 1
        d = gl.where(mk, (G - Gm[None, :]).to(gl.float32), 0.0)  # |d| <= 60 on an unflagged chunk
        # the state terms first, in Triton's order (exp with -inf past the mask: 0 there), so that
        # G and the state accumulators retire before the pair products' operands are made
        dqp = gl.exp(gl.where(mk, G.to(gl.float32), float("-inf"))) * dqh * scale
        decay = gl.exp(gl.where(mk, (GL[None, :] - G).to(gl.float32), float("-inf")))
        is_last = (tok == last)[:, None]
        # Kd * dKd enters dG with - on its row and + (summed) on the last row; the last row's own
        # term is left out of both (as Triton's kernel); rows past the sequence are 0 by select, not
        # by their 0 factors alone (their Vn rows, hence dKd's, are the next sequence's)
        x = gl.where(is_last | ~mk, 0.0, k * decay * dkd)
        dG = q * dqp - x
        dG += gl.where(is_last, (gl.exp(GL.to(gl.float32)) * hdh + gl.sum(x, axis=0))[None, :], 0.0)
        dkp = decay * dkd

        xT_s.store(gl.permute(k * gl.exp(-d), (1, 0)))
        yT_s.store(gl.permute(q * gl.exp(d), (1, 0)))
        fence_async_shared()
        gl.thread_barrier()  # every warp's part of (K e^-d)^T and (Q e^d)^T, before the WGMMAs read them
        # R, then C: each product's register operand (32 registers per thread) and accumulator
        # retire before the other's are made (both in flight: 255 registers and 8 B of spills, sm_90a)
        zero = gl.zeros([BT, BKS], gl.float32, D_L)
        a_M = gl.convert_layout(m_s.load(D_L), gl.DotOperandLayout(operand_index=0, parent=D_L, k_width=1))
        R = warpgroup_mma(a_M, xT_s.permute((1, 0)), zero, is_async=True)
        R, _m, _x = warpgroup_mma_wait(0, deps=[R, a_M, xT_s])
        if gl.num_warps() > 4:
            gl.thread_barrier()  # xT_s is free to the allocator now (M^T's conversion scratch): every warpgroup's read of it is done (triton 11047)
        R = R * gl.exp(d)
        # summed in 9b's order (`_dp_apply_rows`)
        # lint: allow TP001 -- as dW
        gl.store(dq_ptr + base + offs, dqp + R + dd[:, None] * k, mask=mk)
        dG = dG + q * R
        # M^T a transpose in registers, as GDN's 9a forms D^T (checked there on the H200)
        a_Mt = gl.convert_layout(gl.permute(m_s.load(D_L), (1, 0)),
                                 gl.DotOperandLayout(operand_index=0, parent=D_L, k_width=1))
        C = warpgroup_mma(a_Mt, yT_s.permute((1, 0)), zero, is_async=True)
        C, _mt, _y = warpgroup_mma_wait(0, deps=[C, a_Mt, yT_s])
        C = C * gl.exp(-d)
        # lint: allow TP001 -- as dW
        gl.store(dk_ptr + base + offs, dkp + C + dd[:, None] * q, mask=mk)
        # lint: allow TP001 -- as dW
        gl.store(dG_ptr + base + offs, dG - k * C, mask=mk)

    @gluon.jit
    def _dqkwg_tiles_issue(vn_desc, dvn_desc, h_desc, dh_desc, vn_s, dvn_s, h_s, dh_s, bar, bos, hh, srow,
                           V: gl.constexpr, do_desc=None, do16_s=None, DO_TMA: gl.constexpr = False):
        """`_kda_dqkwg_wgmma_kernel`'s TMA loads of one work item (chunk from token bos, head hh,
        key block from row srow of h and dh in [NC H K, V]): Vn, dVn [64, V], h_b, dh_b [64, V] and,
        with DO_TMA, dO [64, V] in 16 bits into do16_s, armed on bar together."""
        NBYTES: gl.constexpr = (vn_desc.block_type.nbytes + dvn_desc.block_type.nbytes + h_desc.block_type.nbytes
                                + dh_desc.block_type.nbytes + (do_desc.block_type.nbytes if DO_TMA else 0))
        mbarrier.expect(bar, NBYTES)
        tma.async_copy_global_to_shared(vn_desc, [bos, hh * V], bar, vn_s)
        tma.async_copy_global_to_shared(dvn_desc, [bos, hh * V], bar, dvn_s)
        tma.async_copy_global_to_shared(h_desc, [srow, 0], bar, h_s)
        tma.async_copy_global_to_shared(dh_desc, [srow, 0], bar, dh_s)
        if DO_TMA:
            tma.async_copy_global_to_shared(do_desc, [bos, hh * V], bar, do16_s)

    @gluon.jit
    def _state_slot_view(slot_s, desc, SIXTEEN: gl.constexpr):
        """Where a TMA copy puts a tile that the kernel multiplies in fp32 (stage 9's states, the dA
        kernel's W_b): its fp32 slot, or (SIXTEEN: a 16-bit tile, widened there later) the first half
        of that slot viewed in the descriptor's dtype and layout."""
        if SIXTEEN:
            gl.static_assert(desc.block_type.nbytes * 2 == slot_s.numel * 4, "a 16-bit tile fills half its fp32 slot")
            return slot_s._reinterpret(desc.dtype, slot_s.shape, desc.layout)
        else:
            return slot_s

    @gluon.jit
    def _widen_pair(a16_s, b16_s, a_s, b_s, L: gl.constexpr):
        """STATES_16BIT, DSTATES_16BIT: two 16-bit state tiles (TMA'd into the first half of their
        fp32 slots) widened to fp32 in those slots: every warp reads its part of both, a CTA barrier
        (the fp32 tiles overwrite the 16-bit ones), then writes it back in fp32. The caller fences
        and barriers before the WGMMAs read them."""
        a = a16_s.load(L).to(gl.float32)
        b = b16_s.load(L).to(gl.float32)
        gl.thread_barrier()
        a_s.store(a)
        b_s.store(b)

    @gluon.jit
    def _dqkwg_state_products(do_s, vn_s, dvn_s, h_s, dh_s, m_s, bos, eos, scale, D_L: gl.constexpr,
                              ROWS_L: gl.constexpr):
        """The item's four state products (tf32 WGMMAs over V, issued together) and, under them,
        hdh = rowsum(h_b * dh_b); then M = strict_lower(scale dP) on the chunk's rows into m_s.
        Returns (dQh, dKd, dW's accumulator, hdh, scale dP's diagonal)."""
        BT: gl.constexpr = vn_s.shape[0]
        BKS: gl.constexpr = h_s.shape[0]
        zero = gl.zeros([BT, BKS], gl.float32, D_L)
        dp = warpgroup_mma(do_s, vn_s.permute((1, 0)), zero, is_async=True)
        dqh = warpgroup_mma(do_s, h_s.permute((1, 0)), zero, is_async=True)
        dkd = warpgroup_mma(vn_s, dh_s.permute((1, 0)), zero, is_async=True)
        dwa = warpgroup_mma(dvn_s, h_s.permute((1, 0)), zero, is_async=True)
        # under them: rowsum(h_b * dh_b) from shared memory (the WGMMAs only read it)
        hdh = gl.convert_layout(gl.sum(h_s.load(ROWS_L) * dh_s.load(ROWS_L), axis=1), gl.SliceLayout(0, D_L))
        # every operand in deps (an operand's shared memory is otherwise free to the allocator)
        dp, dqh, dkd, dwa, _do, _vn, _dvn, _h, _dh = warpgroup_mma_wait(
            0, deps=[dp, dqh, dkd, dwa, do_s, vn_s, dvn_s, h_s, dh_s])
        if gl.num_warps() > 4:
            gl.thread_barrier()  # every warpgroup's WGMMAs are done before scratch reuses their operands (triton 11047)
        # M = strict_lower(scale dP) on the chunk's rows and its diagonal, as Triton's kernel has
        # them (scale dP's lower triangle stored, then read back strict, and dP_tt); M goes to
        # shared memory (read there as both register operands after the barrier in the epilogue)
        ri = gl.arange(0, BT, layout=gl.SliceLayout(1, D_L))
        cj = gl.arange(0, BT, layout=gl.SliceLayout(0, D_L))
        i_ok = bos + ri < eos
        dps = dp * scale
        m_s.store(gl.where((ri[:, None] > cj[None, :]) & i_ok[:, None] & (bos + cj < eos)[None, :], dps, 0.0))
        dd = gl.sum(gl.where((ri[:, None] == cj[None, :]) & i_ok[:, None], dps, 0.0), axis=1)
        return dqh, dkd, dwa, hdh, dd

    @gluon.jit
    def _kda_dqkwg_wgmma_kernel(h_desc, dh_desc, vn_desc, dvn_desc, q_ptr, k_ptr, G_ptr, do_ptr, dq_ptr, dk_ptr, dw_ptr,
                                dG_ptr, chunks_ptr, flags_ptr, H, scale, K: gl.constexpr, V: gl.constexpr,
                                do_desc=None, g_desc=None, q_desc=None, k_desc=None, TMA_TILES: gl.constexpr = False,
                                STATES_16BIT: gl.constexpr = False, DSTATES_16BIT: gl.constexpr = False):
        """Stage 9 with 9b's pair terms for one chunk and head whose flag (stage 3's, int8 [NC, H])
        is clear, for one block of BKS = 64 key channels: what Triton's `_kda_dqkwg_kernel` with
        PAIRS computes for such a chunk (fp32 dQ', dK', dW, dG' [Ntok, H, K]; its dP slices are
        not written: only flagged chunks' are read, by 9b's flagged launch). Grid (NC * K / BKS, H)
        as Triton's, 8 warps (two warpgroups side by side along N); a flagged chunk's programs
        return (Triton's kernel takes it, CHUNKS "flagged"). Every product a tf32 WGMMA on fp32
        operands (Triton's PREC "tf32" for 16-bit inputs):
            dP = dO Vn^T,  dQh = dO h_b^T,  dKd = Vn dh_b^T,  dW = -dVn h_b^T   (over V, issued together)
            hdh = rowsum(h_b * dh_b)   (under them)
            R = e^d (M (K_b e^-d)),  C = e^-d (M^T (Q_b e^d)),  M = strict_lower(scale dP)
            dQ' = exp(G) dQh scale + R + diag(dP) K_b,  dK' = exp(G_L - G) dKd + C + diag(dP) Q_b,
            dG' = Q_b dQ'_state - x + Q_b R - K_b C (+ exp(G_L) hdh + colsum(x) on the last row)
        with d = G - G_m (m the chunk's middle row: |d| <= 60 where the chunk is unflagged) and
        x = K_b exp(G_L - G) dKd off the last row: Triton's exponents, masks and summation order,
        so the two agree to the order of fp32 accumulation (both truncate fp32 operands to tf32:
        Triton's sm_90a PTX has m64n32k8 tf32 WGMMAs and no cvt.rna).
        Explicit here (Triton would choose): h_b, dh_b, Vn and dVn come by TMA as stored (all
        four products contract over V, along which they are contiguous: the K-major B operands
        tf32 needs, h_b and dh_b as transposed views); dO (16-bit) is widened into an fp32 shared
        tile under those loads; M goes through shared memory and becomes the register A operands
        of R and C there (M^T a register transpose), the pair operands K_b e^-d and Q_b e^d are
        written to shared memory transposed; the four state products in flight together, then R,
        then C. 208 KB of shared memory at K = V = 128 (one CTA per SM), 128 KB at 64.
        Why a program per key block, not one per chunk looping over the blocks (Vn, dVn, dO loaded
        and dP formed once): sm_90a at K = V = 128, the loop spilled 320-444 B per thread (the
        compiler kept the blocks' loop-invariant tiles live across them) where the same epilogue,
        one block per program, took 178 registers and none (246 now, with R's and C's gate
        factors); the second block's rows come from L2.
        Rows past the sequence (a varlen tail: the next sequence's TMA rows, finite; zeros past
        the tensor) meet masks: dO's are loaded as 0, M's rows and columns and q, k, G are masked,
        x by select, and the stores by row.
        TMA_TILES (DQKWG_TILES "tma"; bf16 q and k, fp32 G): dO comes by TMA too, in 16 bits into
        M's slot (free until M is formed), widened into its fp32 tile after the wait; the
        epilogue's G, q and k tiles come by TMA on a second mbarrier, issued with the others at
        the item's start, into the pair operands' slots (free until the epilogue writes them):
        G into (K_b e^-d)^T's, q and k into (Q_b e^d)^T's two halves. So every tile's load is in
        flight during the wait for the state tiles, none after the products (ncu at e48d059: the
        pointer loads' long_scoreboard, 2.43 cycles per issued instruction, led the stalls), with
        no more shared memory.
        STATES_16BIT (the forward's kept h and Vn in bf16, triton_kernels.KEPT_STATES_DTYPE "bf16"):
        h_b and Vn come by TMA in 16 bits into the first half of their fp32 slots and are widened
        there after the wait (every warp reads its part, a CTA barrier, then the fp32 stores): the
        same fp32 operands as an fp32 h and Vn holding those bf16 values, for half their bytes.
        DSTATES_16BIT (stage 8's dh and dVn in bf16, triton_kernels.BACKWARD_DSTATES_DTYPE "bf16"):
        dh_b and dVn likewise, widened after h_b and Vn (two tiles at a time: 64 registers a thread).
        Persistent, one program an SM looping over the work items with the next item's TMA loads
        under this item's epilogue, it was slower on the H200 (1.39 -> 1.80 ms at b87a5da; 1.41 ->
        ~1.66 with the epilogue's loads issued first, at 35f9352: kda.md row 41) and was removed."""
        BT: gl.constexpr = vn_desc.block_type.shape[0]
        BKS: gl.constexpr = h_desc.block_type.shape[0]
        NK: gl.constexpr = K // BKS
        gl.static_assert(BKS == BT, "dP and the key block's tiles share one [64, 64] accumulator layout")
        gl.static_assert(NK * BKS == K, "whole key blocks")
        NW: gl.constexpr = gl.num_warps()
        WG: gl.constexpr = NW // 4
        D_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, BKS // WG, 8])
        ROWS_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
        XT_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BKS, BT], gl.float32)
        # the four state tiles' fp32 slots (fp32 [64, V]: the layout the host gives an fp32 one's
        # descriptor); a 16-bit tile (STATES_16BIT, DSTATES_16BIT) lands in the first half of its slot
        ST_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, V], gl.float32)
        gl.static_assert(BKS == BT, "h_b's and Vn's tiles share one slot shape")
        h_s = gl.allocate_shared_memory(gl.float32, [BKS, V], ST_SL)
        dh_s = gl.allocate_shared_memory(gl.float32, [BKS, V], ST_SL)
        vn_s = gl.allocate_shared_memory(gl.float32, [BT, V], ST_SL)
        dvn_s = gl.allocate_shared_memory(gl.float32, [BT, V], ST_SL)
        h_dst = _state_slot_view(h_s, h_desc, STATES_16BIT)
        vn_dst = _state_slot_view(vn_s, vn_desc, STATES_16BIT)
        dh_dst = _state_slot_view(dh_s, dh_desc, DSTATES_16BIT)
        dvn_dst = _state_slot_view(dvn_s, dvn_desc, DSTATES_16BIT)
        do_s = gl.allocate_shared_memory(gl.float32, [BT, V], ST_SL)
        xT_s = gl.allocate_shared_memory(gl.float32, [BKS, BT], XT_SL)  # (K_b e^-d)^T
        yT_s = gl.allocate_shared_memory(gl.float32, [BKS, BT], XT_SL)  # (Q_b e^d)^T
        m_s = gl.allocate_shared_memory(gl.float32, [BT, BT], XT_SL)  # M, read by generic loads only
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        if TMA_TILES:
            # the borrowed slots hold what the host rule (`_dqkwg_tma_fits`) lets through, no more
            # (a larger view would reach into the next buffer without complaint)
            gl.static_assert(do_desc.block_type.nbytes <= BT * BT * 4, "dO's tile fits M's slot")
            gl.static_assert(g_desc.block_type.nbytes == BKS * BT * 4, "G's tile fills (K_b e^-d)^T's slot")
            gl.static_assert(q_desc.dtype == k_desc.dtype, "q and k share one view of (Q_b e^d)^T's slot")
            gl.static_assert(q_desc.block_type.nbytes + k_desc.block_type.nbytes == BKS * BT * 4,
                             "q's and k's tiles fill (Q_b e^d)^T's slot")
            tbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            # views of slots used only later: dO's 16 bits in M's, G in (K_b e^-d)^T's, q and k in
            # (Q_b e^d)^T's halves (bf16 [64, 64] each)
            do16_s = m_s._reinterpret(do_desc.dtype, [BT, V], do_desc.layout)
            g_s = xT_s._reinterpret(g_desc.dtype, [BT, BKS], g_desc.layout)
            qk_s = yT_s._reinterpret(q_desc.dtype, [2, BT, BKS], q_desc.layout)
            q_s, k_s = qk_s.index(0), qk_s.index(1)
        c = gl.program_id(0) // NK
        kb = gl.program_id(0) % NK  # a chunk's key blocks in adjacent programs: its rows' second read from L2
        hh = gl.program_id(1)
        if gl.load(flags_ptr + c * H + hh) == 0:
            bos, eos = _chunk_bounds(chunks_ptr, c)
            mbarrier.init(bar, count=1)
            if TMA_TILES:
                mbarrier.init(tbar, count=1)
            fence_async_shared()
            rr = gl.arange(0, BT, layout=gl.SliceLayout(1, ROWS_L))
            if TMA_TILES:
                _dqkwg_tiles_issue(vn_desc, dvn_desc, h_desc, dh_desc, vn_dst, dvn_dst, h_dst, dh_dst, bar, bos, hh,
                                   (c * H + hh) * K + kb * BKS, V, do_desc, do16_s, True)
                col = hh * K + kb * BKS
                mbarrier.expect(tbar, g_desc.block_type.nbytes + q_desc.block_type.nbytes + k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(g_desc, [bos, col], tbar, g_s)
                tma.async_copy_global_to_shared(q_desc, [bos, col], tbar, q_s)
                tma.async_copy_global_to_shared(k_desc, [bos, col], tbar, k_s)
                mbarrier.wait(bar, 0)
                do = gl.where((bos + rr < eos)[:, None], do16_s.load(ROWS_L).to(gl.float32), 0.0)
                do_s.store(do)
                if STATES_16BIT:
                    _widen_pair(h_dst, vn_dst, h_s, vn_s, ROWS_L)
                if DSTATES_16BIT:
                    _widen_pair(dh_dst, dvn_dst, dh_s, dvn_s, ROWS_L)
                fence_async_shared()
                gl.thread_barrier()  # every warp's part of dO (and the widened states), before the WGMMAs read it
            else:
                _dqkwg_tiles_issue(vn_desc, dvn_desc, h_desc, dh_desc, vn_dst, dvn_dst, h_dst, dh_dst, bar, bos, hh,
                                   (c * H + hh) * K + kb * BKS, V)
                vc = gl.arange(0, V, layout=gl.SliceLayout(0, ROWS_L))
                # lint: allow TP001 -- dO (16-bit) is widened to fp32 on its way to shared memory (tf32 WGMMA takes fp32 operands); rows past the sequence loaded as 0 (the TMA_TILES form takes it by TMA into a 16-bit slot)
                do = gl.load(do_ptr + ((bos + rr).to(gl.int64) * H + hh)[:, None] * V + vc[None, :],
                             mask=(bos + rr < eos)[:, None], other=0.0).to(gl.float32)
                do_s.store(do)
                fence_async_shared()
                gl.thread_barrier()  # every warp's part of dO, before the WGMMAs read it
                mbarrier.wait(bar, 0)
                if STATES_16BIT:
                    _widen_pair(h_dst, vn_dst, h_s, vn_s, ROWS_L)
                if DSTATES_16BIT:
                    _widen_pair(dh_dst, dvn_dst, dh_s, dvn_s, ROWS_L)
                if STATES_16BIT or DSTATES_16BIT:
                    fence_async_shared()
                    gl.thread_barrier()  # every warp's part of the widened states, before the WGMMAs read them
            dqh, dkd, dwa, hdh, dd = _dqkwg_state_products(do_s, vn_s, dvn_s, h_s, dh_s, m_s, bos, eos, scale, D_L,
                                                           ROWS_L)
            if TMA_TILES:
                G, q, k, GL, Gm = _dqkwg_epilogue_tiles(q_ptr, k_ptr, G_ptr, bos, eos, hh, kb, H, K, BKS, BT, D_L,
                                                        g_s, q_s, k_s, tbar, True)
                mbarrier.invalidate(tbar)
            else:
                G, q, k, GL, Gm = _dqkwg_epilogue_tiles(q_ptr, k_ptr, G_ptr, bos, eos, hh, kb, H, K, BKS, BT, D_L)
            _kda_dqkwg_block(dqh, dkd, dwa, hdh, dd, G, q, k, GL, Gm, m_s, xT_s, yT_s, dq_ptr, dk_ptr, dw_ptr,
                             dG_ptr, bos, eos, hh, kb, H, scale, K, BKS)
            mbarrier.invalidate(bar)


def _dqkwg_tma_fits(q, k, G, do) -> bool:
    """Whether stage 9's kernel can take dO and its epilogue's tiles by TMA (TMA_TILES): bf16 q, k
    and dO, fp32 G (the slots they borrow are sized for those), on 16-byte aligned storage."""
    return (q.dtype == k.dtype == do.dtype == torch.bfloat16 and G.dtype == torch.float32
            and all(x.data_ptr() % 16 == 0 for x in (q, k, G, do)))


def dqkwg_kernel_for(q, k, G, h, dh, vn, dvn, do, input_dtype: torch.dtype, span_flags, fuse_9b: bool) -> str:
    """"gluon" or "triton": which kernel takes stage 9's unflagged chunks (BACKWARD_DQKWG, validated
    here). The Gluon kernel takes the whole-chunk route with 9b fused (span_flags and fuse_9b) where
    Triton's stage 9 multiplies in tf32 (`_products` for its input dtype: KDA's stage 9 reads
    BACKWARD_PRODUCTS, not a per-stage entry) on h and Vn both fp32 or both bf16 (the forward's kept
    states, KEPT_STATES_DTYPE) and dh and dVn both fp32 or both bf16 (stage 8's, BACKWARD_DSTATES_DTYPE;
    16-bit tiles widened in the kernel), with per-channel gates G in
    fp32 (GATE_SUMS_16BIT's default; fp64 G compiles, a case of its own, but no GPU test has run it:
    Triton's kernel takes it), q and k both fp32 (l2-normalised) or both bf16 (raw or normalised), dO
    bf16, K == V of 64 or 128, every tensor contiguous on the GPU."""
    kk._checked("DQKWG_TILES", DQKWG_TILES, ("tma", "loads"))  # validated with the switch, before any fallback
    if kk._checked("BACKWARD_DQKWG", BACKWARD_DQKWG, _KERNEL_CHOICES) == "triton" or span_flags is None or not fuse_9b:
        return "triton"
    K, V = q.shape[-1], do.shape[-1]
    shapes = K == V and K in HEAD_DIMS and K % DQKWG_BKS == 0 and k.shape == q.shape == G.shape
    dtypes = (q.dtype in (torch.float32, torch.bfloat16) and k.dtype == q.dtype and do.dtype == torch.bfloat16
              and G.dtype == torch.float32 and span_flags.dtype == torch.int8
              and all(a.dtype == b.dtype and a.dtype in (torch.float32, torch.bfloat16) for a, b in ((h, vn), (dh, dvn))))
    tensors = (q, k, G, h, dh, vn, dvn, do, span_flags)
    placed = all(x.is_cuda and x.is_contiguous() for x in tensors)
    tf32 = kk._products(input_dtype, True)[2].removesuffix("-emulated") == "tf32"  # (the interpreter's name)
    return "gluon" if shapes and dtypes and placed and tf32 else "triton"


def chunk_dqkwg_kda_gluon(q, k, G, h, dh, vn, dvn, do, scale: float, plan, input_dtype: torch.dtype, span_flags=None,
                          fuse_9b: bool = False, worklist=None):
    """Stage 9 (`triton_kernels.chunk_dqkwg_kda`'s contract and return value: dq, dk, dw, dG fp32
    [Ntok, H, K] and dP's slice 0): where `dqkwg_kernel_for` says so, the unflagged chunks on
    `_kda_dqkwg_wgmma_kernel` and the flagged ones on Triton's kernel into the same buffers; Triton's
    stage 9 whole otherwise. dP's slices are allocated as Triton's fused launch has them; the Gluon
    kernel writes none (only flagged chunks' slice 0 is read after stage 9, by 9b's flagged launch)."""
    if dqkwg_kernel_for(q, k, G, h, dh, vn, dvn, do, input_dtype, span_flags, fuse_9b) == "triton":
        return kk.chunk_dqkwg_kda(q, k, G, h, dh, vn, dvn, do, scale, plan, input_dtype, span_flags=span_flags,
                                  fuse_9b=fuse_9b, worklist=worklist)
    Ntok, H, K = q.shape
    V = do.shape[-1]
    dq, dk, dw, dG = (new_empty((Ntok, H, K), torch.float32, q.device) for _ in range(4))
    dp = new_empty((kk._key_split(K)[1], Ntok, H, BT), torch.float32, q.device)
    if plan.NC:
        descs = (_descriptor(h.view(plan.NC * H * K, V), [DQKWG_BKS, V]),
                 _descriptor(dh.view(plan.NC * H * K, V), [DQKWG_BKS, V]),
                 _descriptor(vn.view(Ntok, H * V), [BT, V]), _descriptor(dvn.view(Ntok, H * V), [BT, V]))
        args = (q, k, G, do, dq, dk, dw, dG, plan.chunks, span_flags, H, float(scale), K, V)
        tiles = {}
        if kk._checked("DQKWG_TILES", DQKWG_TILES, ("tma", "loads")) == "tma" and _dqkwg_tma_fits(q, k, G, do):
            tiles = dict(do_desc=_descriptor(do.view(Ntok, H * V), [BT, V]),
                         g_desc=_descriptor(G.view(Ntok, H * K), [BT, DQKWG_BKS]),
                         q_desc=_descriptor(q.view(Ntok, H * K), [BT, DQKWG_BKS]),
                         k_desc=_descriptor(k.view(Ntok, H * K), [BT, DQKWG_BKS]), TMA_TILES=True)
        _kda_dqkwg_wgmma_kernel[(plan.NC * (K // DQKWG_BKS), H)](*descs, *args, **tiles,
                                                                 STATES_16BIT=h.dtype != torch.float32,
                                                                 DSTATES_16BIT=dh.dtype != torch.float32, num_warps=8)
    return kk.chunk_dqkwg_kda(q, k, G, h, dh, vn, dvn, do, scale, plan, input_dtype, span_flags=span_flags,
                              fuse_9b=True, outputs=(dq, dk, dw, dG, dp), worklist=worklist)


def _dqkwg_compile_cases():
    """`_kda_dqkwg_wgmma_kernel` at K = V = 128 and 64, with the key operands the backward hands it:
    fp32 (l2-normalised q and k) and bf16 (raw); G in fp32 (16-bit inputs' GATE_SUMS_16BIT default)
    and, at 128, fp64 (GATE_SUMS_16BIT "fp64")."""
    from tileport.compile_check import CompileCase, TensorStandIn, descriptor_stand_in

    cases = []
    Ntok, H, NC = 32768, 16, 512
    f32, bf = torch.float32, torch.bfloat16
    for K, keys, g_dtype in ((128, f32, f32), (128, bf, f32), (128, f32, torch.float64), (64, f32, f32), (64, bf, f32)):
        V = K

        def desc32(rows, cols, block):
            return descriptor_stand_in([rows, cols], f32, block, _smem_layout(block, f32))

        rows = TensorStandIn([Ntok, H, K], f32)
        args = dict(h_desc=desc32(NC * H * K, V, [DQKWG_BKS, V]), dh_desc=desc32(NC * H * K, V, [DQKWG_BKS, V]),
                    vn_desc=desc32(Ntok, H * V, [BT, V]), dvn_desc=desc32(Ntok, H * V, [BT, V]),
                    q_ptr=TensorStandIn([Ntok, H, K], keys), k_ptr=TensorStandIn([Ntok, H, K], keys),
                    G_ptr=TensorStandIn([Ntok, H, K], g_dtype), do_ptr=TensorStandIn([Ntok, H, V], bf), dq_ptr=rows,
                    dk_ptr=rows, dw_ptr=rows, dG_ptr=rows, chunks_ptr=TensorStandIn([2 * NC], torch.int32),
                    flags_ptr=TensorStandIn([NC, H], torch.int8), H=H, scale=0.1, K=K, V=V)
        tag = f"K{K}_V{V}_keys{'fp32' if keys == f32 else 'bf16'}_G{'fp32' if g_dtype == f32 else 'fp64'}"
        cases.append(CompileCase(name=f"kda_dqkwg_{tag}_w8", kernel=_kda_dqkwg_wgmma_kernel, args=args, num_warps=8,
                                 expect_ptx=["wgmma.mma_async.sync.aligned.m64n", "tf32.tf32", "cp.async.bulk.tensor",
                                             "mbarrier.try_wait"],
                                 expect_max_spills=0, expect_max_shared=SMEM_PER_SM))
        if keys == bf and g_dtype == f32:
            # the TMA_TILES form (DQKWG_TILES "tma"): dO, G, q and k by TMA into borrowed slots
            def tile_desc(dtype, cols, block_cols):
                return descriptor_stand_in([Ntok, H * cols], dtype, [BT, block_cols],
                                           _smem_layout((BT, block_cols), dtype))

            targs = dict(args, do_desc=tile_desc(bf, V, V), g_desc=tile_desc(f32, K, DQKWG_BKS),
                         q_desc=tile_desc(bf, K, DQKWG_BKS), k_desc=tile_desc(bf, K, DQKWG_BKS), TMA_TILES=True)
            cases.append(CompileCase(name=f"kda_dqkwg_tma_tiles_{tag}_w8", kernel=_kda_dqkwg_wgmma_kernel, args=targs,
                                     num_warps=8,
                                     expect_ptx=["wgmma.mma_async.sync.aligned.m64n", "tf32.tf32",
                                                 "cp.async.bulk.tensor", "mbarrier.try_wait"],
                                     expect_max_spills=0, expect_max_shared=SMEM_PER_SM))
            # 16-bit states, with the loads' and the TMA tiles' forms: the forward's kept h and Vn in
            # bf16 (STATES_16BIT), stage 8's dh and dVn (DSTATES_16BIT), all four
            state16 = descriptor_stand_in([NC * H * K, V], bf, [DQKWG_BKS, V], _smem_layout((DQKWG_BKS, V), bf))
            h16 = dict(h_desc=state16, vn_desc=tile_desc(bf, V, V), STATES_16BIT=True)
            dh16 = dict(dh_desc=state16, dvn_desc=tile_desc(bf, V, V), DSTATES_16BIT=True)
            for form, form_args in (("loads", args), ("tma_tiles", targs)):
                for which, sargs in (("states16", h16), ("dstates16", dh16), ("allstates16", dict(h16, **dh16))):
                    cases.append(CompileCase(name=f"kda_dqkwg_{form}_{which}_{tag}_w8", kernel=_kda_dqkwg_wgmma_kernel,
                                             args=dict(form_args, **sargs), num_warps=8,
                                             expect_ptx=["wgmma.mma_async.sync.aligned.m64n", "tf32.tf32",
                                                         "cp.async.bulk.tensor", "mbarrier.try_wait"],
                                             expect_max_spills=0, expect_max_shared=SMEM_PER_SM))
    return cases


def kda_forward_gluon(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                      keep_for_backward: bool = False):
    """Triton's forward with stage 3 on `chunk_solve_wu_kda_gluon`, and stages 5 and 6 fused on
    `chunk_states_output_kda_gluon` where it takes them, else stage 5 on Triton's kernel and stage 6
    on `chunk_output_kda_gluon` (keep_for_backward as there)."""
    return kk.kda_forward_triton(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                 cu_seqlens, output=chunk_output_kda_gluon, keep_for_backward=keep_for_backward,
                                 solve=chunk_solve_wu_kda_gluon, states_output=chunk_states_output_kda_gluon,
                                 states_output_form=states_output_kernel_for)


def kda_backward_gluon(do, dht, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                       kept=None):
    """Triton's backward with its two state recurrences (the recompute's stage 5 and stage 8) on
    GDN's Gluon tf32 recurrence kernel in its PER_CHANNEL form, where that kernel takes them
    (`gdn.gluon_kernels.recurrence_kernel_for`: tf32 products on fp32 operands; Triton's otherwise);
    kept: what the forward kept (`triton_kernels.KeptTiles`), as there."""
    return kk.kda_backward_triton(do, dht, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
                                  cu_seqlens, states=chunk_states_recompute_gluon, dstates=chunk_dstates_gluon,
                                  kept=kept, dqkwg=chunk_dqkwg_kda_gluon, wy_bwd=chunk_wy_bwd_kda_gluon,
                                  dv_local=chunk_dv_local_kda_gluon)


# --------------------------------------------------------------------------------------------
# CPU compile checks (tileport.compile_check)
# --------------------------------------------------------------------------------------------
def compile_cases():
    """The output kernel at K = V = 128 and 64, with G in fp32 (16-bit inputs' GATE_SUMS_16BIT
    default) and, at 128, fp64."""
    if _GLUON_ERROR is not None:
        return []
    from tileport.compile_check import CompileCase, TensorStandIn, descriptor_stand_in

    cases = []
    Ntok, H, NC = 32768, 16, 512
    bf = torch.bfloat16
    expect = ["wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait"]
    for K, g_dtype in ((128, torch.float32), (128, torch.float64), (64, torch.float32)):
        V = K

        def desc(rows, cols, block):
            return descriptor_stand_in([rows, cols], bf, block, _smem_layout(block, bf))

        args = dict(q_desc=desc(Ntok, H * K, [BT, K]), k_desc=desc(Ntok, H * K, [BT, K]),
                    vn_desc=desc(Ntok, H * V, [BT, V]), h_desc=desc(NC * H * K, V, [K, V]),
                    G_ptr=TensorStandIn([Ntok, H, K], g_dtype), o_ptr=TensorStandIn([Ntok, H, V], bf),
                    chunks_ptr=TensorStandIn([2 * NC], torch.int64),  # int64: keeps the int32 cast of TMA coordinates tested
                    flags_ptr=TensorStandIn([NC, H], torch.int8), H=H, scale=0.1, K=K, V=V)
        tag = f"K{K}_V{V}_G{'fp32' if g_dtype == torch.float32 else 'fp64'}"
        cases.append(CompileCase(name=f"kda_output_{tag}", kernel=_kda_output_wgmma_kernel, args=args, num_warps=4,
                                 expect_ptx=expect, expect_max_spills=0, expect_max_shared=SMEM_PER_SM // 2))
    cases += _solve_compile_cases(Ntok, H, NC)
    cases += _states_output_compile_cases(Ntok, H, NC)
    cases += _wy_bwd_compile_cases(Ntok, H, NC)
    cases += _dqkwg_compile_cases()
    cases += _dv_local_compile_cases()
    return cases


def _states_output_compile_cases(Ntok: int, H: int, NC: int) -> list:
    """The fused states + output kernel at K = V = 128 (BV 128 on 8 warps, the default) and
    K = V = 64 (BV 64 on 8 warps), with an initial and a final state and without: TMA, WGMMA, no
    spills, within an SM's shared memory. (BV 64 on 4 warps at K = 128 spills 348 bytes a thread
    on sm_90a: the [64, K] gate, key and query tiles on half the threads; not a checked form.)"""
    from tileport.compile_check import CompileCase, TensorStandIn, descriptor_stand_in

    f32, bf = torch.float32, torch.bfloat16
    N = Ntok // 4096

    def desc(D, block):
        return descriptor_stand_in([Ntok, H * D], bf, block, _smem_layout(tuple(block), bf))

    cases = []
    # from_t: T's dtype (fp32 where a backward keeps it, bf16 where only this kernel reads it), or None
    # q_regs: Q_NORM "registers" (with q normalised in the kernel: gates "ahead" and from_t)
    # keep: STORE_STATES (a training forward: fp32 T, h and Vn stored for the backward, in "fp32" or
    # "bf16": triton_kernels.KEPT_STATES_DTYPE), or False
    for K, BV, warps, states, gates, from_t, q_regs, keep in (
            (128, 128, 8, True, "top", None, False, False), (128, 128, 8, False, "top", None, False, False),
            (64, 64, 8, True, "top", None, False, False), (128, 128, 8, True, "ahead", None, False, False),
            (128, 128, 8, True, "ahead", f32, False, False), (128, 128, 8, False, "top", f32, False, False),
            (64, 64, 8, True, "ahead", f32, False, False), (128, 128, 8, False, "ahead", bf, False, False),
            (64, 64, 8, True, "ahead", bf, False, False), (128, 128, 8, False, "ahead", bf, True, False),
            (128, 128, 8, True, "ahead", bf, True, False), (128, 128, 8, False, "ahead", f32, False, "fp32"),
            (128, 128, 8, True, "ahead", f32, False, "fp32"), (64, 64, 8, True, "ahead", f32, False, "fp32"),
            (128, 128, 8, False, "top", f32, False, "fp32"), (128, 128, 8, True, "ahead", f32, False, "bf16"),
            (64, 64, 8, True, "ahead", f32, False, "bf16")):
        V = K
        hv = f32 if keep == "fp32" else bf
        args = dict(q_desc=desc(K, [BT, K]), k_desc=desc(K, [BT, K]), w_desc=desc(K, [BT, K]), u_desc=desc(V, [BT, BV]),
                    o_desc=desc(V, [BT, BV]), G_ptr=TensorStandIn([Ntok, H, K], f32),
                    h0_ptr=TensorStandIn([N, H, K, V], f32), ht_ptr=TensorStandIn([N, H, K, V], f32),
                    o_ptr=TensorStandIn([Ntok, H, V], bf), h_ptr=TensorStandIn([NC, H, K, V], hv),
                    vn_ptr=TensorStandIn([Ntok, H, V], hv), cu_ptr=TensorStandIn([N + 1], torch.int32),
                    choff_ptr=TensorStandIn([N + 1], torch.int32), flags_ptr=TensorStandIn([NC, H], torch.int8),
                    H=H, scale=0.1, K=K, V=V, BV=BV, HAS_H0=states, STORE_FINAL=states, GATES=gates)
        if from_t is not None:
            args.update(t_desc=descriptor_stand_in([Ntok, H * BT], from_t, [BT, BT], _smem_layout((BT, BT), from_t)),
                        beta_ptr=TensorStandIn([Ntok, H], bf), VN_FROM_T=True, qn_ptr=TensorStandIn([Ntok, H, K], bf),
                        eps=1e-6, L2NORM_Q=gates == "ahead", Q_IN_REGISTERS=q_regs, STORE_STATES=bool(keep))
        tag = f"K{K}_BV{BV}_w{warps}{'_states' if states else ''}_{gates}"
        tag += "" if from_t is None else "_from_t" if from_t == f32 else "_from_t16"
        tag += ("_l2q_regs" if q_regs else "_l2q") if from_t is not None and gates == "ahead" else ""
        tag += {False: "", "fp32": "_keep", "bf16": "_keep16"}[keep]
        # 4 B of spills at K = 128 with an initial and a final state and q normalised in the kernel
        # (sm_90a; 0 without either, and in every other case): one register, at 255 a thread; 24 B
        # with the states stored too (the training forward's kernel with both states)
        spills = (24 if keep else 4) if (from_t is not None and states and K == 128 and args.get("L2NORM_Q")) else 0
        cases.append(CompileCase(name=f"kda_states_output_{tag}", kernel=_kda_states_output_kernel, args=args,
                                 num_warps=warps, expect_ptx=["wgmma.mma_async", "cp.async.bulk.tensor",
                                                              "mbarrier.try_wait"],
                                 expect_max_spills=spills, expect_max_shared=SMEM_PER_SM))
    return cases


def _solve_compile_cases(Ntok: int, H: int, NC: int) -> list:
    """The forward's stage-3 kernel at K = V = 128 (T kept for the backward, and not) and 64, with
    fp32 g (what `solve_kernel_for` takes): both product types on tensor cores, TMA, no spills, room
    for two programs an SM."""
    from tileport.compile_check import CompileCase, TensorStandIn, descriptor_stand_in

    f32, bf = torch.float32, torch.bfloat16

    def desc(D, dtype):
        return descriptor_stand_in([Ntok, H * D], dtype, [BT, SOLVE_CW], _smem_layout((BT, SOLVE_CW), dtype))

    cases = []
    for K, store_T in ((128, True), (128, False), (64, True)):
        V = K
        args = dict(g_desc=desc(K, f32), k_desc=desc(K, bf), v_desc=desc(V, bf), beta_ptr=TensorStandIn([Ntok, H], bf),
                    G_ptr=TensorStandIn([Ntok, H, K], f32),
                    t_ptr=TensorStandIn([Ntok, H, BT], f32) if store_T else TensorStandIn([Ntok, H, K], bf),
                    w_ptr=TensorStandIn([Ntok, H, K], bf), u_ptr=TensorStandIn([Ntok, H, V], bf),
                    chunks_ptr=TensorStandIn([2 * NC], torch.int64), flags_ptr=TensorStandIn([NC, H], torch.int8),
                    H=H, K=K, V=V, STORE_T=store_T, SPAN_MAX=CHUNK_SPAN_MAX)
        tag = f"K{K}_V{V}{'_T' if store_T else ''}"
        cases.append(CompileCase(name=f"kda_solve_{tag}", kernel=_kda_solve_wgmma_kernel, args=args, num_warps=4,
                                 expect_ptx=["wgmma.mma_async", "f32.tf32.tf32", "f32.bf16.bf16", "cp.async.bulk.tensor"],
                                 expect_max_spills=0, expect_max_shared=SMEM_PER_SM // 2))
    return cases


def _wy_bwd_compile_cases(Ntok: int, H: int, NC: int) -> list:
    """Stage 10's kernels at K = V = 128 and 64 with l2-normalised keys (fp32 k, fp32 dk: the bench's
    case) and, at 128, raw bf16 keys (bf16 dk) and a bf16 g (its dg): the one-kernel form and the
    split form's two kernels (WY_FORM)."""
    from tileport.compile_check import CompileCase, TensorStandIn, descriptor_stand_in

    f32, bf = torch.float32, torch.bfloat16
    cases = []
    for K, k_dtype, g_dtype in ((128, f32, f32), (64, f32, f32), (128, bf, bf)):
        V = K

        def t(*shape, dtype=f32):
            return TensorStandIn(list(shape), dtype)

        def desc():
            return descriptor_stand_in([Ntok, H * K], f32, [BT, CB], _smem_layout((BT, CB), f32))

        args = dict(u_desc=desc(), w_desc=desc(), t_ptr=t(Ntok, H, BT), dw_ptr=t(Ntok, H, K), dvn_ptr=t(Ntok, H, V),
                    k_ptr=t(Ntok, H, K, dtype=k_dtype), v_ptr=t(Ntok, H, V, dtype=bf), beta_ptr=t(Ntok, H, dtype=bf),
                    G_ptr=t(Ntok, H, K), dkp_ptr=t(Ntok, H, K), dGp_ptr=t(Ntok, H, K),
                    dk_ptr=t(Ntok, H, K, dtype=k_dtype), dv_ptr=t(Ntok, H, V, dtype=bf), dbeta_ptr=t(Ntok, H, dtype=bf),
                    dg_ptr=t(Ntok, H, K, dtype=g_dtype), chunks_ptr=t(2 * NC, dtype=torch.int64),
                    flags_ptr=t(NC, H, dtype=torch.int8), H=H, K=K, V=V)
        tag = f"K{K}_V{V}_k{'fp32' if k_dtype == f32 else 'bf16'}_g{'fp32' if g_dtype == f32 else 'bf16'}"
        cases.append(CompileCase(name=f"kda_wy_bwd_{tag}", kernel=_kda_wy_bwd_wgmma_kernel, args=args, num_warps=8,
                                 expect_ptx=["wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait"],
                                 expect_max_spills=0, expect_max_shared=SMEM_PER_SM))
        # the split form (WY_FORM "split"): both kernels must leave room for two programs an SM
        mm = descriptor_stand_in([NC * H * BT, 2 * BT], f32, [BT, BT], _smem_layout((BT, BT), f32))
        split_args = {
            "dA": (_kda_wy_dA_kernel, dict(
                u_desc=desc(), w_desc=desc(), t_ptr=t(Ntok, H, BT), dw_ptr=t(Ntok, H, K), dvn_ptr=t(Ntok, H, V),
                v_ptr=t(Ntok, H, V, dtype=bf), beta_ptr=t(Ntok, H, dtype=bf), dv_ptr=t(Ntok, H, V, dtype=bf),
                vdu_ptr=t(Ntok, H), dxw_ptr=t(Ntok, H, K), mm_desc=mm, chunks_ptr=t(2 * NC, dtype=torch.int64),
                flags_ptr=t(NC, H, dtype=torch.int8), H=H, K=K, V=V)),
            "pairs": (_kda_wy_pairs_kernel, dict(
                m_desc=mm, dxw_ptr=t(Ntok, H, K), k_ptr=t(Ntok, H, K, dtype=k_dtype),
                beta_ptr=t(Ntok, H, dtype=bf), G_ptr=t(Ntok, H, K), dkp_ptr=t(Ntok, H, K), dGp_ptr=t(Ntok, H, K),
                vdu_ptr=t(Ntok, H), dk_ptr=t(Ntok, H, K, dtype=k_dtype), dbeta_ptr=t(Ntok, H, dtype=bf),
                dg_ptr=t(Ntok, H, K, dtype=g_dtype), chunks_ptr=t(2 * NC, dtype=torch.int64),
                flags_ptr=t(NC, H, dtype=torch.int8), H=H, K=K, CW=_PAIRS_CHANNELS)),
        }
        # U never formed (U_FREE, triton_kernels.BACKWARD_U_FROM_T): W's descriptor stands in for U's
        split_args["dA_ufree"] = (_kda_wy_dA_kernel, dict(split_args["dA"][1], U_FREE=True))
        # the dA kernel's dVn and dW tiles by TMA (DA_TILES "tma", the default), U formed or not
        for part in ("dA", "dA_ufree"):
            split_args[f"{part}_tma"] = (_kda_wy_dA_kernel, dict(split_args[part][1], dvn_desc=desc(), dw_desc=desc(),
                                                                 TMA_TILES=True))
        if k_dtype == f32:
            # stage 8's dVn in bf16 (BACKWARD_DSTATES_DTYPE "bf16"), loaded or by TMA, U_FREE
            dvn16 = descriptor_stand_in([Ntok, H * V], bf, [BT, CB], _smem_layout((BT, CB), bf))
            split_args["dA_ufree_dvn16"] = (_kda_wy_dA_kernel, dict(split_args["dA_ufree"][1],
                                                                    dvn_ptr=t(Ntok, H, V, dtype=bf)))
            split_args["dA_ufree_tma_dvn16"] = (_kda_wy_dA_kernel, dict(split_args["dA_ufree_tma"][1],
                                                                        dvn_ptr=t(Ntok, H, V, dtype=bf),
                                                                        dvn_desc=dvn16))
            # the backward's W in bf16 (BACKWARD_W_DTYPE "bf16"): widened in its slot, U formed or not,
            # dVn's tiles loaded or by TMA, and with dVn in bf16 as well
            w16 = descriptor_stand_in([Ntok, H * K], bf, [BT, CB], _smem_layout((BT, CB), bf))
            split_args["dA_w16"] = (_kda_wy_dA_kernel, dict(split_args["dA"][1], w_desc=w16))
            split_args["dA_ufree_w16"] = (_kda_wy_dA_kernel, dict(split_args["dA_ufree"][1], w_desc=w16))
            split_args["dA_ufree_tma_w16_dvn16"] = (_kda_wy_dA_kernel, dict(split_args["dA_ufree_tma_dvn16"][1],
                                                                            w_desc=w16))

        def tile_desc(dtype=f32):
            return descriptor_stand_in([Ntok, H * K], dtype, [BT, _PAIRS_CHANNELS],
                                       _smem_layout((BT, _PAIRS_CHANNELS), dtype))

        # the pairs kernel's tiles by TMA (PAIRS_TILES "tma", the default)
        split_args["pairs_tma"] = (_kda_wy_pairs_kernel, dict(
            split_args["pairs"][1], g_desc=tile_desc(), dxw_desc=tile_desc(), dkp_desc=tile_desc(),
            k_desc=tile_desc(k_dtype), dgp_desc=tile_desc(), TMA_TILES=True))
        # the gated keys from the accumulator layout's tiles (PAIRS_GATED_KEYS "accumulator")
        split_args["pairs_tma_acckeys"] = (_kda_wy_pairs_kernel, dict(split_args["pairs_tma"][1], KEYS_FROM_ACC=True))
        for part, (kernel, kargs) in split_args.items():
            cases.append(CompileCase(name=f"kda_wy_split_{part}_{tag}", kernel=kernel, args=kargs, num_warps=4,
                                     expect_ptx=["wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait"],
                                     expect_max_spills=0, expect_max_shared=SMEM_PER_SM // 2))
    return cases
