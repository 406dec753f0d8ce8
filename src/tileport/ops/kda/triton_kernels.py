"""Kimi Delta Attention, Triton backend: GDN's chunked algorithm with per-channel gates.

KDA differs from GDN only in how the gates scale k, q and the state, so most stages are GDN's own
kernels (tileport.ops.gdn.triton_kernels) with their PER_CHANNEL constexpr switched on, selected by
the gate cumsum G having a key axis ([Ntok, H, K] instead of [Ntok, H]):

     1 l2norm_fwd     GDN's, unchanged
     2 chunk_cumsum   GDN's, PER_CHANNEL: G = in-chunk cumsum of g per key channel (fp64)
     3 chunk_solve_wu GDN's, PER_CHANNEL: A_ts = beta_t sum_c k_tc k_sc exp(G_tc - G_sc),
                      W = T diag(beta) (exp(G) * K)
     5 chunk_states   GDN's, PER_CHANNEL: h <- diag(exp(G_L)) h + (exp(G_L - G) * K)^T Vn
     6 kda output     here (`_kda_output_kernel`): the intra-chunk Q K^T product needs the
                      sub-block structure below, which does not fit GDN's single [64, 64] tile

Gate exponents (same scheme as the float64 `kda.reference.gated_products`): a per-channel product
sum_c x_tc k_sc exp(G_tc - G_sc) can't be split into exp(G_t) and exp(-G_s) factors (exp(-G_s)
overflows fp32 after a few steps of -20), so the chunk's 64 rows are taken in sub-blocks of 16. Rows
of sub-block i against columns of earlier sub-blocks use the reference point r = first row of
block i: (x_t exp(G_t - G_r)) . (k_s exp(G_r - G_s)), a tensor-core dot whose factors are both
scaled by exp(<= 0); the diagonal 16 x 16 block is formed from the exact pairwise differences as
a [16, 16, BK] fp32 product. For g <= 0 no exponent is positive, for any gate magnitude (-20,
-1000, ...): a factor can only underflow to 0, where the exact term is below fp32's range anyway.
For fp32 inputs G stays fp64 and every exponent is an fp64 difference rounded to fp32 (see GDN's
docstring); for 16-bit inputs (GATE_SUMS_16BIT "fp32", the default since the fourteenth session) G
is stored in fp32 and the differences are fp32.

Backward (`kda_backward_triton`): the forward's stages 1-5 recomputed (T stored, fp32
intermediates), or, from what a training forward kept (`KeptTiles`), W and U formed from its T
and, where it kept them, its states h and Vn taken as they are; then

     7 kda dv_local   here: dVl = scale P^T dO by 16-row blocks                  grid (NC*V/BV, H)
     8 chunk_dstates  GDN's, PER_CHANNEL: dVn, dh per chunk, d initial_state      grid (N*H, V/BV)
     9 kda dqkwg      here: dQ', dK', dW, dG' partials and dP (stored)            grid (NC, H)
    9b kda dp apply   here: + the pair terms of dP (gated products R, C)          grid (NC, H)
    10 kda wy_bwd     here: back through W, U, T: dV, dA (stored), dbeta'         grid (NC, H)
   10b kda da apply   here: + the pair terms of dA; final dK, dbeta, dg            grid (NC, H)
    11 l2norm_bwd     GDN's

R(M, X) and C(M, Y), the gated products in both directions, follow the exponent rule above
(`_gated_rows`, `_gated_cols`); tests/kda_chunk_algebra.py holds the same algebra in float64.
Precision as GDN's backward: the products go through `_mm` at GDN's BACKWARD_PRODUCTS (tf32) for
16-bit inputs.

Interpreter workarounds (bf16 dots and stores) are GDN's: `_op`, `_out`, `_done`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tileport.memory import new_empty
from tileport.ops.gdn.triton_kernels import (
    _F32,
    BT,
    L2NORM_EPS,
    _blocks,
    _checked,
    _chunk_gate_offsets,
    _chunk_middle_gates,
    _done,
    _dot_types,
    _key_split,
    _flatten,
    _mm,
    _not_this_route,
    _op,
    _out,
    _products,
    _tile_precisions,
    _wu_from_t_kernel,
    chunk_cumsum,
    chunk_dstates,
    chunk_solve_wu,
    chunk_states,
    flagged_worklist,
    l2norm_bwd,
    l2norm_fwd,
    make_plan,
    triton_refusal,
    worklist_programs,
)
from tileport.shapes import cdiv, next_pow2

__all__ = ["kda_forward_triton", "kda_backward_triton", "chunk_output_kda", "triton_refusal"]

_LAUNCH_OUTPUT = dict(num_warps=4)
# The output kernel's warps where it takes whole chunks (DIAGONAL_FORM "chunk"): sm_90a at K = V =
# 128, bf16, when one kernel held both routes: 4 warps 255 registers and 204 B of spills per thread,
# 8 warps 255 and none (the whole-chunk launch alone now: OUTPUT_CHUNK_BV below). H200, S1:
# the whole forward with 4 warps 2.681 ms (kda_ab.py at 7ae6627), with 8 warps 3.032 (the bench in
# the same call, another process); at e89bd5a (half the chunks on the block path) 4.490 against
# 5.333 in one run. 4 until a same-run A/B says otherwise.
OUTPUT_CHUNK_WARPS = 4
# ... and its block of value columns: 64 (two programs per chunk and head at V = 128, each forming
# the chunk's [64, 64] P) or 128 (one, P formed once; a [128, 128] h tile). sm_90a, K = V = 128,
# bf16, the whole-chunk launch: BV 64 4w 255 registers, no spills, 8w 173; BV 128 8w 200, none,
# 4w 32 B (docs/perf/kda.md row 7). Not timed yet.
OUTPUT_CHUNK_BV = 64
# How stage 3 (GDN's solve kernel, PER_CHANNEL), the output kernel and the backward's block kernels
# (dv_local and the gated products of 9b and 10b) form each 16-row sub-block's diagonal block:
# "exact" (pairwise exponents, always) or "factored" (reference-row factors when the sub-block's
# gates span at most SPAN_MAX, the exact form otherwise); or, in the forward of 16-bit inputs,
# "chunk": stage 3 and the output kernel take a whole chunk as one [64, K] x [K, 64] product of
# factors through its middle row where its gates span at most 60 about it (`_chunk_gate_span`),
# GDN's tile solve (`_solve_wu_tile_kernel`, PER_CHANNEL) instead of the 16x16 chain, and the
# "factored" blocks elsewhere (the backward as "factored"). H200 at 15abe43 (scripts/kda_ab.py, S1):
# the forward 13.005 ms exact, 5.945 factored (o within 3.5e-3 normwise; the output kernel 7.3 ms
# and stage 3 4.6 of the exact form's 13.0). "chunk" the default from the twelfth session, with its
# H200 A/B and gate in the same call (docs/perf/kda.md, row 6).
DIAGONAL_FORM = "chunk"
# Whether a forward that autograd will differentiate (the eager path, with an input that requires a
# gradient) keeps what stage 3 formed for its backward: G (the in-chunk gate sums, fp32 for 16-bit
# inputs), T = (I + A)^-1 per chunk (fp32 [Ntok, H, 64], at the forward's precisions) and the
# chunks' span flags; the backward then forms its exact W and U from T (`chunk_wu_from_t_kda`)
# instead of recomputing stage 3 (the tile solve and G: 1.15 ms of the gluon backward's 8.6 at S1,
# docs/perf/kda.md row 19). FLA's chunk_kda keeps its forward's gate sums and both in-chunk
# matrices (saved for backward). Costs the forward T's store (134 MB at S1) and keeps G and T
# (402 MB at S1) as saved tensors until the backward. Only with whole-chunk flags (16-bit inputs)
# and BACKWARD_WHOLE_CHUNKS (the blocks backward would not read them); read at each call.
KEEP_FORWARD_TILES = True
# Whether a keeping forward (KEEP_FORWARD_TILES) in the gluon backend's "fused-t" form also keeps
# every chunk's state h entering it and its Vn (fp32, [NC, H, K, V] and [Ntok, H, V]: 805 MB at S1),
# stored by the fused kernel from the registers they are in (STORE_STATES), so the backward takes
# them instead of recomputing stage 5 (its tf32 recurrence over W and U formed from T: ~0.7 ms of
# the gluon backward at S1, docs/perf/kda.md "The backward's bytes", cut 1). The kept h and Vn are
# the forward's own (bf16 operands, as its o was formed), not the recompute's tf32 ones. Read at
# each call.
KEEP_FORWARD_STATES = True
# The dtype of the kept h and Vn for 16-bit inputs: "fp32" or "bf16" (for bf16 inputs the values
# the forward's own WGMMAs took, h and Vn being rounded to bf16 as its operands; bf16 and not fp16
# for fp16 inputs, whose range exp(G) factors can underflow: kda.md, "W in bf16, precision"; half
# the bytes, 402 MB less written at S1 and read again by stage 9, whose Gluon kernel widens them).
# The backward's gradients then move: CPU interpreter, the gate's bf16 cases, dg up to 3.0e-3 and
# dq, dk up to 4.0e-3 normwise from the float64 reference against 1e-3-3.6e-3 with fp32 states
# (docs/perf/kda.md, thirtieth session), inside the gate's bounds. "fp32" until the H200 has timed
# it (kda_ab "kept-states-16bit", kda.md row 48).
KEPT_STATES_DTYPE = "fp32"
# The dtype of stage 8's dh [NC, H, K, V] and dVn [Ntok, H, V] for 16-bit inputs: "fp32" or "bf16"
# (as FLA keeps dh and dv2: stored rounded, the recurrence carrying fp32; stage 9 and 10 widen them
# where they read them). Half the bytes: 402 MB less written by stage 8 at S1, ~400 MB less read by
# stage 9 (dVn twice: once per key block) and 134 MB less by stage 10's dA kernel. CPU interpreter
# (scripts/kda_states_precision.py, the gate's 16-bit cases, with h and Vn in 16 bits as well): the
# worst gradient error 0.43 of the gate's bound against 0.36 with fp32 states (docs/perf/kda.md,
# row 49). "fp32" until the H200 has timed it (kda_ab "dstates-16bit").
BACKWARD_DSTATES_DTYPE = "fp32"
# The dtype of the backward's W [Ntok, H, K] formed from the kept T (`chunk_wu_from_t_kda`) for
# 16-bit inputs: "fp32" or "bf16" (stored rounded; stage 8 and stage 10 widen it where they read
# it). bf16 and never fp16: for fp16 inputs with steep gates exp(G) underflows fp16 (kda.md, "W in
# bf16, precision": d initial_state 3.1e-2 against the bound 1e-2). 134 MB less written at S1 and
# 134 MB less read by stage 8 and by stage 10's dA kernel each. "fp32" until the H200 has timed it
# (kda_ab "w-16bit", kda.md row 50).
BACKWARD_W_DTYPE = "fp32"


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.jit
def _kda_output_kernel(q_ptr, k_ptr, G_ptr, h_ptr, vn_ptr, o_ptr, chunks_ptr, H, scale,
                       K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                       BT: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr,
                       FACTORED_DIAGONAL: tl.constexpr = False, SPAN_MAX: tl.constexpr = 40.0,
                       CHUNKS: tl.constexpr = "all", flags_ptr=None):
    """6: O = scale ((exp(G) * Q) h_c + lower[sum_c q_tc k_sc exp(G_tc - G_sc)] Vn), in o's dtype,
    one 16-row sub-block of the chunk at a time (see the module docstring for the exponents);
    grid (NC * V/BV, H).

    FACTORED_DIAGONAL: a sub-block whose gates span at most SPAN_MAX (max |G_s - G_r| over its
    rows and channels, checked at run time) forms its diagonal block like the earlier ones, from
    the reference-row factors, so the whole row block is one tensor-core dot; steeper sub-blocks
    keep the exact pairwise [16, 16, K] form. Why: that form's reduction over key channels is a
    shuffle tree across lanes (5120 shfl per thread, sm_90a PTX) and set the kernel's issue floor
    at 1.47 ms at S1 (docs/perf/kda.md); exp(SPAN_MAX) = 2.4e17 keeps every factor finite in bf16.

    CHUNKS (DIAGONAL_FORM "chunk" sets it, reading stage 3's flags at flags_ptr): "all" (every
    chunk by sub-blocks, as above), "whole" (only the chunks stage 3 did not flag, those whose
    gates span at most 60 about their middle row (`_chunk_gate_span`), each formed whole by
    `_kda_output_chunk`; the others return) or "flagged" (only the flagged chunks, by sub-blocks,
    from their worklist at flags_ptr (`flagged_worklist`) on a persistent grid (P,): a grid
    (NC * V/BV, H) of programs returning at their flag cost ~26 us at S1 with no chunk flagged).
    Two launches rather than one kernel with both paths: the sub-block path needs all 255
    registers, and one kernel holding both gave the whole-chunk path its register budget too."""
    if CHUNKS == "flagged":  # a persistent grid over the worklist: its programs take every num_programs-th item
        # a while loop: as a for loop (scf.for) the body spilled (sm_90a: 48 B against 28 outside
        # any loop; the block solve's 1020 against 104), as a while loop it does not add any
        i = tl.program_id(0)
        n = tl.load(flags_ptr) * NV
        while i < n:
            item = tl.load(flags_ptr + 1 + i // NV)
            j = i % NV
            i += tl.num_programs(0)
            _kda_output_program(item // H, j, item % H, q_ptr, k_ptr, G_ptr, h_ptr, vn_ptr, o_ptr, chunks_ptr,
                                H, scale, K, V, BK, BV, BT, DT, DA, FACTORED_DIAGONAL, SPAN_MAX, False)
    else:
        c = tl.program_id(0) // NV
        hh = tl.program_id(1)
        if not _not_this_route(CHUNKS, flags_ptr, c, H, hh):
            _kda_output_program(c, tl.program_id(0) % NV, hh, q_ptr, k_ptr, G_ptr, h_ptr, vn_ptr, o_ptr, chunks_ptr,
                                H, scale, K, V, BK, BV, BT, DT, DA, FACTORED_DIAGONAL, SPAN_MAX, CHUNKS == "whole")


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence
@triton.jit
def _kda_output_program(c, j, hh, q_ptr, k_ptr, G_ptr, h_ptr, vn_ptr, o_ptr, chunks_ptr, H, scale,
                        K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                        DT: tl.constexpr, DA: tl.constexpr, FACTORED_DIAGONAL: tl.constexpr, SPAN_MAX: tl.constexpr,
                        WHOLE: tl.constexpr):
    """`_kda_output_kernel`'s work for value block j of chunk c, head hh: whole (WHOLE) or by
    16-row sub-blocks."""
    bos = tl.load(chunks_ptr + 2 * c)
    eos = tl.load(chunks_ptr + 2 * c + 1)
    r = tl.arange(0, BT)
    kc = tl.arange(0, BK)
    vc = j * BV + tl.arange(0, BV)
    tok = bos + r
    valid = tok < eos
    row = tok.to(tl.int64) * H + hh
    mv = valid[:, None] & (vc < V)[None, :]
    vn = _op(tl.load(vn_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0), DT, DA)
    h = _op(tl.load(h_ptr + (c.to(tl.int64) * H + hh) * (K * V) + kc[:, None] * V + vc[None, :],
                    mask=(kc < K)[:, None] & (vc < V)[None, :], other=0.0), DT, DA)
    if WHOLE:
        _kda_output_chunk(q_ptr, k_ptr, G_ptr, h, vn, o_ptr, row, valid, bos, eos, H, hh, vc, scale, K, V, BK, BT,
                          DT, DA)
    else:
        _kda_output_blocks(q_ptr, k_ptr, G_ptr, h, vn, vn_ptr, o_ptr, row, valid, bos, eos, H, hh, vc, scale, K, V, BK, BV,
                           BT, DT, DA, FACTORED_DIAGONAL, SPAN_MAX)


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.jit
def _kda_output_chunk(q_ptr, k_ptr, G_ptr, h, vn, o_ptr, row, valid, bos, eos, H, hh, vc, scale, K: tl.constexpr,
                      V: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr):
    """6 for a whole chunk whose gates span at most 60 about its middle row m (stage 3 left its
    flag clear): P = lower((Q * exp(G - G_m)) (K * exp(G_m - G))^T), one [64, K] x [K, 64]
    product (the factors are finite; the lower triangle's terms are the exact ones up to their
    rounding, the upper one is masked out), then O = scale ((exp(G) * Q) h + P Vn) for this V
    block. G is read once: exp(G) as exp(d + G_m), d = G - G_m (fp32 rounding of G either way)."""
    kc = tl.arange(0, BK)
    r = tl.arange(0, BT)
    mk = valid[:, None] & (kc < K)[None, :]
    q = tl.load(q_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0).to(tl.float32)
    d, Gm = _chunk_gate_offsets(G_ptr, row, mk, bos, eos, H, hh, kc, K, BT)
    o = tl.dot(_op(q * tl.exp(d + Gm.to(tl.float32)[None, :]), DT, DA), h, input_precision="ieee")
    kt = tl.load(k_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0).to(tl.float32)
    P = tl.dot(_op(q * tl.exp(d), DT, DA), tl.trans(_op(kt * tl.exp(-d), DT, DA)), input_precision="ieee")
    P = tl.where((r[:, None] >= r[None, :]) & valid[:, None] & valid[None, :], P, 0.0)
    o += tl.dot(_op(P, DT, DA), vn, input_precision="ieee")
    tl.store(o_ptr + row[:, None] * V + vc[None, :], (o * scale).to(o_ptr.dtype.element_ty),
             mask=valid[:, None] & (vc < V)[None, :])


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.jit
def _kda_output_blocks(q_ptr, k_ptr, G_ptr, h, vn, vn_ptr, o_ptr, row, valid, bos, eos, H, hh, vc, scale, K: tl.constexpr,
                       V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, DT: tl.constexpr,
                       DA: tl.constexpr, FACTORED_DIAGONAL: tl.constexpr, SPAN_MAX: tl.constexpr):
    """6 for a chunk by 16-row sub-blocks (`_kda_output_kernel`'s docstring says how)."""
    NB: tl.constexpr = BT // 16
    CB: tl.constexpr = 32 if BK > 32 else BK
    r = tl.arange(0, BT)
    r16 = tl.arange(0, 16)
    kc = tl.arange(0, BK)
    incl = r16[:, None] >= r16[None, :]
    for i in tl.static_range(NB):
        ti = bos + i * 16 + r16
        vi = ti < eos
        rowi = ti.to(tl.int64) * H + hh
        mki = vi[:, None] & (kc < K)[None, :]
        mvi = vi[:, None] & (vc < V)[None, :]
        qi = tl.load(q_ptr + rowi[:, None] * K + kc[None, :], mask=mki, other=0.0).to(tl.float32)
        Gi = tl.load(G_ptr + rowi[:, None] * K + kc[None, :], mask=mki, other=0.0)
        oi = tl.dot(_op(qi * tl.exp(Gi.to(tl.float32)), DT, DA), h, input_precision="ieee")
        tr = bos + i * 16  # reference row r (row 0 of this sub-block)
        r_ok = tr < eos
        Gr = tl.load(G_ptr + (tr.to(tl.int64) * H + hh) * K + kc, mask=r_ok & (kc < K), other=0.0)
        xq = qi * tl.exp(tl.where(mki, (Gi - Gr[None, :]).to(tl.float32), float("-inf")))
        # the largest |G_s - G_r| over this sub-block's rows and channels: below SPAN_MAX, the
        # diagonal block takes the factored form too (its exp(G_r - G_s) >= 1 factors stay below
        # exp(SPAN_MAX)), and the whole row block is one [16, K] x [K, 64] dot
        span = tl.max(tl.max(tl.where(mki, tl.abs(Gi - Gr[None, :]), 0.0), 1), 0)
        if FACTORED_DIAGONAL and span <= SPAN_MAX:
            # column blocks jb <= i one [16, K] tile at a time (the whole [64, K] k and fp64 G
            # tiles at once spilled 376 B per thread, sm_90a)
            xqo = _op(xq, DT, DA)
            for jb in tl.static_range(i + 1):
                tj = bos + jb * 16 + r16
                vj = (tj < eos) & r_ok
                rowj = tj.to(tl.int64) * H + hh
                mkj = vj[:, None] & (kc < K)[None, :]
                kj = tl.load(k_ptr + rowj[:, None] * K + kc[None, :], mask=mkj, other=0.0).to(tl.float32)
                Gj = tl.load(G_ptr + rowj[:, None] * K + kc[None, :], mask=mkj, other=0.0)
                ktj = kj * tl.exp(tl.where(mkj, (Gr[None, :] - Gj).to(tl.float32), float("-inf")))
                Pj = tl.dot(xqo, tl.trans(_op(ktj, DT, DA)), input_precision="ieee")  # [16, 16]
                if jb == i:
                    Pj = tl.where(incl & vi[:, None] & vj[None, :], Pj, 0.0)
                vnj = _op(tl.load(vn_ptr + rowj[:, None] * V + vc[None, :], mask=vj[:, None] & (vc < V)[None, :],
                                  other=0.0), DT, DA)
                oi += tl.dot(_op(Pj, DT, DA), vnj, input_precision="ieee")
        else:
            # diagonal sub-block: exact pairwise exponents, [16, 16, CB] over CB key channels at a
            # time (the whole [16, 16, K] product, beside the chunk's [64, K] k and fp64 G tiles held
            # through the loop, spilled 6.9 KB per thread on sm_90a; those tiles are now loaded where used)
            vni = _op(tl.load(vn_ptr + rowi[:, None] * V + vc[None, :], mask=mvi, other=0.0), DT, DA)
            Pd = tl.full([16, 16], 0.0, tl.float32)
            for cb in tl.static_range(0, BK, CB):
                cc = cb + tl.arange(0, CB)
                mkc = vi[:, None] & (cc < K)[None, :]
                qc = tl.load(q_ptr + rowi[:, None] * K + cc[None, :], mask=mkc, other=0.0).to(tl.float32)
                kcc = tl.load(k_ptr + rowi[:, None] * K + cc[None, :], mask=mkc, other=0.0).to(tl.float32)
                Gcc = tl.load(G_ptr + rowi[:, None] * K + cc[None, :], mask=mkc, other=0.0)
                keep3 = (incl & vi[:, None] & vi[None, :])[:, :, None] & (cc < K)[None, None, :]
                e3 = tl.exp(tl.where(keep3, (Gcc[:, None, :] - Gcc[None, :, :]).to(tl.float32), float("-inf")))
                Pd += tl.sum(qc[:, None, :] * kcc[None, :, :] * e3, 2)
            oi += tl.dot(_op(Pd, DT, DA), vni, input_precision="ieee")
            if i > 0:
                before = valid & (r < i * 16) & r_ok
                mkb = before[:, None] & (kc < K)[None, :]
                k = tl.load(k_ptr + row[:, None] * K + kc[None, :], mask=mkb, other=0.0).to(tl.float32)
                G = tl.load(G_ptr + row[:, None] * K + kc[None, :], mask=mkb, other=0.0)
                kt = k * tl.exp(tl.where(mkb, (Gr[None, :] - G).to(tl.float32), float("-inf")))
                P = tl.dot(_op(xq, DT, DA), tl.trans(_op(kt, DT, DA)), input_precision="ieee")  # 0 where s >= r
                oi += tl.dot(_op(P, DT, DA), vn, input_precision="ieee")
        tl.store(o_ptr + rowi[:, None] * V + vc[None, :], (oi * scale).to(o_ptr.dtype.element_ty), mask=mvi)


def _output_launch(q, k, G, h, vn, o, scale: float, plan, chunks: str, span_flags=None, block_v: int | None = None,
                   num_warps: int | None = None, worklist=None):
    """One launch of `_kda_output_kernel` over the chunks that `chunks` names ("all", "whole" or
    "flagged": see its docstring) into o, block_v value columns per program; "flagged" takes the
    flags' worklist (`flagged_worklist`) where the caller formed it."""
    H, K = q.shape[1:]
    V = vn.shape[-1]
    BK, BV, _ = _blocks(K, V)
    BV = min(block_v or BV, BV * cdiv(V, BV))
    launch = dict(_LAUNCH_OUTPUT, num_warps=num_warps or _LAUNCH_OUTPUT["num_warps"])
    grid = (plan.NC * cdiv(V, BV), H)
    if chunks == "flagged":
        grid = (worklist_programs(q.device, plan.NC * cdiv(V, BV) * H),)
        span_flags = worklist if worklist is not None else flagged_worklist(span_flags)
    _kda_output_kernel[grid](q, k, G, h, vn, o, plan.chunks, H, scale, K, V, BK, BV, cdiv(V, BV),
                             BT, *_dot_types(q.dtype), _factored_diagonal(), CHUNKS=chunks,
                             flags_ptr=span_flags, **launch)


def output_flagged_chunks(q, k, G, h, vn, o, scale: float, plan, span_flags, worklist=None) -> None:
    """6 for the chunks stage 3 flagged (gates spanning more than 60 about the middle row), by
    16-row sub-blocks, into o: the part of stage 6 the Gluon backend leaves to Triton (worklist:
    the flags' `flagged_worklist`, where the forward formed it with stage 3)."""
    if plan.NC:
        _output_launch(q, k, G, h, vn, o, scale, plan, "flagged", span_flags, worklist=worklist)


def chunk_output_kda(q, k, G, h, vn, scale: float, plan, out_dtype: torch.dtype, span_flags=None):
    """6: o [Ntok, H, V] in out_dtype; G [Ntok, H, K] (`_gate_sums_dtype`). span_flags: stage 3's
    per-chunk flags (DIAGONAL_FORM "chunk"): the chunks it left unflagged are formed whole."""
    Ntok, H, K = q.shape
    V = vn.shape[-1]
    o = _out((Ntok, H, V), out_dtype, q.device)
    if plan.NC:
        if span_flags is None:
            _output_launch(q, k, G, h, vn, o, scale, plan, "all")
        else:  # the whole chunks, then the flagged ones by sub-blocks (their programs return fast)
            _output_launch(q, k, G, h, vn, o, scale, plan, "whole", span_flags, OUTPUT_CHUNK_BV, OUTPUT_CHUNK_WARPS)
            output_flagged_chunks(q, k, G, h, vn, o, scale, plan, span_flags)
    return _done(o, out_dtype)


def _span_flags(plan, H: int, q: torch.Tensor, wanted: bool):
    """Stage 3's per-chunk flags (int8 [NC, H], filled by it) where DIAGONAL_FORM "chunk" takes whole
    chunks (16-bit inputs; fp32 inputs keep the block kernels, as GDN's do) and the caller wants
    them; None otherwise (every chunk by 16-row blocks)."""
    if wanted and DIAGONAL_FORM == "chunk" and q.dtype != torch.float32 and plan.NC:
        return torch.empty((plan.NC, H), dtype=torch.int8, device=q.device)
    return None


# Where KDA's in-chunk gate sums G (stage 2, fp64 [Ntok, H, K]) are formed when stage 3 takes whole
# chunks (DIAGONAL_FORM "chunk", 16-bit inputs): "stage-2" (`_cumsum_kernel`, then stage 3 reads G)
# or "stage-3" (`_solve_wu_tile_kernel` with CUMSUM_G reads g, forms G in 32-channel blocks, stores
# it and reads it back from L2 for the span and A: stage 2's launch and one HBM read of G, 537 MB
# at S1, saved in the forward and again in the backward's recompute). kda.md row 12: on the H200
# (217fafc, S1) forward 2.617 -> 2.596 ms and backward 12.937 -> 12.773, and with fp32 G (row 13)
# 2.007 -> 1.993 and 11.732 -> 11.682; the default since the fourteenth session.
CUMSUM_FORM = "stage-3"


# The dtype G is stored in for 16-bit inputs: "fp64" (every input dtype; the sums and every exponent
# difference exact to fp64, as GDN's docstring says why for fp32 inputs) or "fp32" (each sum formed
# in fp64 and rounded once as stored: half the bytes of every read of G, ~10 per forward and
# backward, 268 MB each at S1; an exponent difference then carries ~|G| 6e-8 of rounding, 1e-3
# at |G| = 16000, against bf16's 4e-3 on every operand). fp32 inputs keep fp64. kda.md row 13: on
# the H200 (fourteenth session, S1) forward 2.617 -> 2.007 ms, backward 12.937 -> 11.732, errors
# unchanged; the default since.
GATE_SUMS_16BIT = "fp32"


# Where the gluon backend's "fused-t" forward normalises k (use_qk_l2norm_in_kernel): "stage-1"
# (`l2norm_fwd`, then stage 3 and the fused kernel read the normalised keys) or "stage-3" (the tile
# kernel normalises each chunk's keys as it loads them and stores them, flagged chunks' included,
# for the block kernel, the fused kernel and the flagged output: stage 1's launch and one read of
# k saved, ~0.05 ms at S1 by bytes). The same keys to the bit (`_load_keys` rounds as
# `l2norm_fwd` stores: tests/test_kda_gluon_states.py). H200 (twenty-second session, S1, one run):
# the forward 0.979 -> 0.961 ms, o and the final state bitwise equal (docs/perf/kda.md row 29).
KEYS_NORMALISED_IN = "stage-3"


# The dtype of T in the gluon backend's "fused-t" forward when no backward keeps it (no_grad, or
# KEEP_FORWARD_TILES off): "fp32" or "input" (bf16: the fused kernel rounds T to bf16 as it reads
# it for its WGMMA, and stage 3 now rounds it so as it stores it, the same rounding to nearest
# even: o unchanged to the bit, 134 MB less written by stage 3 and read by the fused kernel at S1).
# A forward that keeps T for its backward stores fp32 (the backward's W and U take fp32 T).
FORWARD_T_DTYPE = "input"


def _gate_sums_dtype(input_dtype: torch.dtype) -> torch.dtype:
    form = _checked("GATE_SUMS_16BIT", GATE_SUMS_16BIT, ("fp64", "fp32"))
    return torch.float32 if form == "fp32" and input_dtype != torch.float32 else torch.float64


def _gate_sums(gf: torch.Tensor, plan, flags, input_dtype: torch.dtype):
    """(G, g for stage 3): stage 2 here (G formed, g None), or, with CUMSUM_FORM "stage-3" and
    stage 3 in whole chunks (flags), G allocated for stage 3 to form from g. G in
    `_gate_sums_dtype(input_dtype)`."""
    dtype = _gate_sums_dtype(input_dtype)
    if _checked("CUMSUM_FORM", CUMSUM_FORM, ("stage-2", "stage-3")) == "stage-3" and flags is not None:
        return new_empty(tuple(gf.shape), dtype, gf.device), gf
    return chunk_cumsum(gf, plan, dtype), None


def _factored_diagonal() -> bool:
    """Whether the 16-row blocks form their diagonal block from reference-row factors where the
    gates allow it (DIAGONAL_FORM "factored", and "chunk" for the blocks it leaves to them)."""
    return _checked("DIAGONAL_FORM", DIAGONAL_FORM, ("exact", "factored", "chunk")) != "exact"


def kda_forward_triton(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                       output=None, keep_for_backward: bool = False, solve=None, states_output=None,
                       states_output_form=None):
    """(o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32 or None), and with
    keep_for_backward a third item: `KeptTiles` for `kda_backward_triton` (KEEP_FORWARD_TILES), or
    None. output, solve: the functions that run stage 6 (`chunk_output_kda`'s contract) and stage 3
    (`chunk_solve_wu`'s, as called here); None: this module's, looked up at the call (a default
    argument would bind the function at definition, past a test's spy); the Gluon backend passes
    its own. states_output_form, states_output: the Gluon backend's rule for stages 5 and 6
    (`gluon_kernels.states_output_kernel_for`: "split" here, or fused in one kernel from W and U,
    "fused", or from T, "fused-t", for which stage 3 stops at T and stage 1 leaves q to the
    kernel) and its fused stage (`gluon_kernels.chunk_states_output_kda_gluon`'s contract)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    plan = make_plan(B, T, cu_seqlens, q.device)
    qf, kf, vf, gf, bf = (_flatten(x) for x in (q, k, v, g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    factored = _factored_diagonal()
    flags = _span_flags(plan, H, q, True)
    G, g_in_3 = _gate_sums(gf, plan, flags, q.dtype)  # G [Ntok, H, K], formed by stage 2 or by stage 3 from g
    keep = keep_for_backward and KEEP_FORWARD_TILES and BACKWARD_WHOLE_CHUNKS and flags is not None
    form = states_output_form(qf, kf, vf, G, flags) if states_output_form is not None else "split"
    from_t = form == "fused-t"
    keys_in = _checked("KEYS_NORMALISED_IN", KEYS_NORMALISED_IN, ("stage-1", "stage-3"))
    t_form = _checked("FORWARD_T_DTYPE", FORWARD_T_DTYPE, ("fp32", "input"))
    # "fused-t" with KEYS_NORMALISED_IN "stage-3": stage 3 normalises k and stores it in kn
    kn = new_empty(tuple(kf.shape), kf.dtype, kf.device) if use_qk_l2norm_in_kernel and from_t \
        and keys_in == "stage-3" else None
    if use_qk_l2norm_in_kernel and kn is None:
        kf = l2norm_fwd(kf)
    if use_qk_l2norm_in_kernel and not from_t:  # "fused-t" normalises q in its kernel
        qf = l2norm_fwd(qf)
    solve_kwargs = ({"with_wu": False} if from_t else {}) | ({"l2norm_k": True, "kn_out": kn} if kn is not None else {})
    if from_t and not keep and t_form == "input":
        solve_kwargs["t_dtype"] = vf.dtype  # T read by the fused kernel alone, which rounds it to v's dtype
    fused = form in ("fused", "fused-t")
    # every chunk's h and Vn, stored by the fused kernel for the backward (KEEP_FORWARD_STATES)
    kept_dtype = (torch.bfloat16 if _checked("KEPT_STATES_DTYPE", KEPT_STATES_DTYPE, ("fp32", "bf16")) == "bf16"
                  and vf.dtype in (torch.bfloat16, torch.float16) else _F32)
    states_kept = ((new_empty((plan.NC, H, K, V), kept_dtype, q.device), new_empty((vf.shape[0], H, V), kept_dtype,
                                                                                   q.device))
                   if keep and from_t and KEEP_FORWARD_STATES else None)
    # the fused forms' flagged launches (stage 3's and the output's) share one worklist, formed by stage 3
    worklist = new_empty((1 + plan.NC * H,), torch.int32, q.device) if fused and flags is not None else None
    if worklist is not None:
        solve_kwargs["worklist_out"] = worklist
    Ai, w, u = (solve or chunk_solve_wu)(kf, vf, bf, G, plan, store_T=keep or from_t, compact=True,
                                         factored_diagonal=factored,
                                         keys_normalised=use_qk_l2norm_in_kernel and flags is not None, g=g_in_3,
                                         span_flags=flags, **solve_kwargs)
    kf = kf if kn is None else kn
    if from_t:
        o, ht = states_output(qf, kf, G, h0, plan, output_final_state, scale, flags, T=Ai, v=vf, beta=bf,
                              l2norm_q=use_qk_l2norm_in_kernel, worklist=worklist, states_out=states_kept)
    elif form == "fused":
        o, ht = states_output(qf, kf, G, h0, plan, output_final_state, scale, flags, w=w, u=u, worklist=worklist)
    else:
        h, vn, ht = chunk_states(kf, w, u, G, h0, plan, output_final_state)
        o = (output or chunk_output_kda)(qf, kf, G, h, vn, scale, plan, q.dtype, span_flags=flags)
    if not keep_for_backward:
        return o.view(B, T, H, V), ht
    kept_keys = kf if use_qk_l2norm_in_kernel else None  # normalised above (l2norm_fwd, or stage 3's kn)
    return o.view(B, T, H, V), ht, (KeptTiles(G, Ai, flags, *(states_kept or (None, None)), kn=kept_keys)
                                    if keep else None)


class KeptTiles(NamedTuple):
    """What KDA's forward keeps for its backward (KEEP_FORWARD_TILES): G [Ntok, H, K] (the in-chunk
    gate sums), T [Ntok, H, 64] fp32 (each chunk's (I + A)^-1, row t of its chunk) and the span
    flags int8 [NC, H] (which chunks stage 3 left to its 16-row blocks). Saved for the backward
    with ctx.save_for_backward (`tileport.delta_rule_ops`): freed after it, and seen by saved-tensor
    hooks (activation checkpointing, offloading) as the op's inputs are. h [NC, H, K, V] and Vn
    [Ntok, H, V] (fp32, or bf16 for 16-bit inputs: KEPT_STATES_DTYPE): every chunk's state entering it
    and its Vn, where the forward's fused kernel stored them (KEEP_FORWARD_STATES), else None (the
    backward recomputes them). kn [Ntok,
    H, K] in the inputs' dtype: the l2-normalised keys the forward used (stage 3's or
    `l2norm_fwd`'s, the same to the bit), where it normalised them (use_qk_l2norm_in_kernel), else
    None; the backward takes them where its own normalised keys would be in that dtype
    (BACKWARD_NORMALISED_QK "input"), instead of normalising k again: 134 MB less read and written at
    S1, for a saved tensor of k's size."""

    G: torch.Tensor
    T: torch.Tensor
    flags: torch.Tensor
    h: torch.Tensor | None = None
    vn: torch.Tensor | None = None
    kn: torch.Tensor | None = None


def chunk_wu_from_t_kda(T, k, v, beta, G, flags, plan, input_dtype: torch.dtype, keys_normalised: bool,
                        with_u: bool = True, w_dtype: torch.dtype = torch.float32):
    """The backward's W [Ntok, H, K] and U [Ntok, H, V] (fp32) from its forward's T, as its
    recompute of stage 3 forms them (EXACT_WU: fp32 operands): W = T (diag(beta) (exp(G) * K)),
    U = T diag(beta) V; GDN's `_wu_from_t_kernel` with PER_CHANNEL, grid (NC * D / BC, H) per
    output and route: the whole chunks' products at the tile kernel's precision, the flagged
    chunks' at tf32x3 (the block kernel forms them in fp32). with_u False: (W, None), U not formed
    (BACKWARD_U_FROM_T). w_dtype: W's, fp32 or bf16 (BACKWARD_W_DTYPE; the kernel rounds to nearest
    where it stores bf16)."""
    Ntok, H, K = k.shape
    V = v.shape[-1]
    if w_dtype not in (_F32, torch.bfloat16):
        raise ValueError(f"w_dtype must be torch.float32 or torch.bfloat16, got {w_dtype}")
    w = new_empty((Ntok, H, K), w_dtype, k.device)
    u = new_empty((Ntok, H, V), _F32, k.device) if with_u else None
    if not plan.NC:
        return w, u
    prec, _ = _tile_precisions(input_dtype, False, True, True, keys_normalised)
    # the flagged chunks at tf32x3 (three tf32 passes, error near fp32's): their recompute's block
    # products are fp32 FMA ("ieee"), which as one [64, 64] product spill 536 B at 4 warps (sm_90a)
    for route, route_prec in (("whole", prec), ("flagged", "tf32x3")):
        for x, out, gated in ((k, w, True), (v, u, False))[:2 if with_u else 1]:
            D = x.shape[-1]
            BC = min(64, max(16, next_pow2(D)))
            _wu_from_t_kernel[(plan.NC * cdiv(D, BC), H)](T, x, beta, G, out, plan.chunks, H, D, BC, cdiv(D, BC), BT,
                                                          _F32, _F32, gated, PER_CHANNEL=True, PREC=route_prec,
                                                          CHUNKS=route, flags_ptr=flags, **WU_FROM_T_KDA_LAUNCH)
    return w, u


# `chunk_wu_from_t_kda`'s launch: one [64, 64] fp32 T and a [64, BC] tile per program. Untimed.
WU_FROM_T_KDA_LAUNCH = dict(num_warps=4, num_stages=1)


# ----------------------------------------------------------------------------------------
# backward (docs/perf/kda.md, "The Triton backward"; tests/kda_chunk_algebra.py is the same algebra
# in float64, line by line). Per chunk, the gated products in both directions, for M lower
# triangular [64, 64] and X, Y [64, K]:
#     R(M, X)_tc = sum_s M_ts X_sc exp(G_tc - G_sc)       C(M, Y)_sc = sum_t M_ts Y_tc exp(G_tc - G_sc)
# by 16-row blocks with the forward's exponent rule (`gated_products`): a block pair i > j goes
# through the reference row r = the first row of block i, (.. exp(G_t - G_r)) (.. exp(G_r - G_s)),
# both exponents <= 0; a diagonal block uses the exact pairwise differences, one row (R: one
# column s; C: one row t) at a time as a [16, K] fp32 update, so no [16, 16, K] tile is held.
# Every product of fp32 operands goes through GDN's `_mm` at the backward's precision.
# ----------------------------------------------------------------------------------------


@triton.jit
def _block_rows(bos, eos, b, H, hh, kc, K: tl.constexpr, ROWS: tl.constexpr = 16):
    """The chunk's block b of ROWS rows (16; BT for the whole chunk): rows valid [ROWS], [Ntok, H]
    row offsets [ROWS] (int64), key mask [ROWS, len(kc)]."""
    t = bos + b * ROWS + tl.arange(0, ROWS)
    ok = t < eos
    return ok, t.to(tl.int64) * H + hh, ok[:, None] & (kc < K)[None, :]


# lint: allow-function TP001,TP007 -- [16, K] block tiles and [16, 16] blocks of M inside a chunk of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _block_tile(ptr, rows, mk, kc, K: tl.constexpr):
    """A [16, BK] tile of a [Ntok, H, K] tensor at `rows` (from `_block_rows`), in fp32; 0 off `mk`."""
    return tl.load(ptr + rows[:, None] * K + kc[None, :], mask=mk, other=0.0).to(tl.float32)


# lint: allow-function TP001,TP007 -- [16, K] block tiles and [16, 16] blocks of M inside a chunk of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _block_gates(G_ptr, bos, eos, b, H, hh, rows, mk, kc, K: tl.constexpr):
    """Block b's gates G [16, BK] (fp64), its first row G_r [BK] (the block's reference row) and
    whether that row exists (r_ok: a block past the sequence's end has none, and G_r = 0 there would
    give exp(-G_s) > 1, so every factor through it is masked with r_ok)."""
    tr = bos + b * 16
    r_ok = tr < eos
    Gb = tl.load(G_ptr + rows[:, None] * K + kc[None, :], mask=mk, other=0.0)
    Gr = tl.load(G_ptr + (tr.to(tl.int64) * H + hh) * K + kc, mask=r_ok & (kc < K), other=0.0)
    return Gb, Gr, r_ok


@triton.jit
def _span(Gb, Gr, mk):
    """max |G - G_r| over a block's valid rows and channels: FACTORED's test (exp(span) must stay finite)."""
    return tl.max(tl.max(tl.where(mk, tl.abs(Gb - Gr[None, :]), 0.0), 1), 0)


# lint: allow-function TP001,TP007 -- [16, K] block tiles and [16, 16] blocks of M inside a chunk of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _m_block(m_ptr, rows_i, ok_i, j, ok_j, BT: tl.constexpr):
    """The [16, 16] block (row block of rows_i, column block j) of M, stored [Ntok, H, 64]."""
    return tl.load(m_ptr + rows_i[:, None] * BT + (j * 16 + tl.arange(0, 16))[None, :],
                   mask=ok_i[:, None] & ok_j[None, :], other=0.0)


# lint: allow-function TP001,TP007 -- [16, K] block tiles and [16, 16] blocks of M inside a chunk of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _gated_rows(m_ptr, x_ptr, G_ptr, bos, eos, b: tl.constexpr, H, hh, K: tl.constexpr, BK: tl.constexpr,
                BT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr, STRICT: tl.constexpr,
                FACTORED: tl.constexpr, SPAN_MAX: tl.constexpr):
    """R(M, X) for the rows of block b: [16, BK] fp32. M is read from a [Ntok, H, 64] buffer (row t
    of a chunk holds M_t, columns s = 0..63), X from [Ntok, H, K], G fp64 [Ntok, H, K]. STRICT:
    without the diagonal terms s = t. Earlier blocks j < b and, with FACTORED, a diagonal block whose
    gates span at most SPAN_MAX go through block b's first row r: (M (X_s exp(G_r - G_s))) then
    exp(G_t - G_r), the first factor <= 1 for j < b and <= exp(span) on the diagonal; otherwise
    the diagonal block takes the exact pairwise exponents (`_gated_rows_diagonal`)."""
    r16 = tl.arange(0, 16)
    kc = tl.arange(0, BK)
    okb, rowb, mkb = _block_rows(bos, eos, b, H, hh, kc, K)
    Gb, Gr, r_ok = _block_gates(G_ptr, bos, eos, b, H, hh, rowb, mkb, kc, K)
    acc = tl.full([16, BK], 0.0, tl.float32)
    for j in tl.static_range(b):
        okj, rowj, mkj = _block_rows(bos, eos, j, H, hh, kc, K)
        Gj = tl.load(G_ptr + rowj[:, None] * K + kc[None, :], mask=mkj, other=0.0)
        xs = _block_tile(x_ptr, rowj, mkj, kc, K) * tl.exp(
            tl.where(mkj & r_ok, (Gr[None, :] - Gj).to(tl.float32), float("-inf")))
        acc += _mm(_m_block(m_ptr, rowb, okb, j, okj, BT), xs, PREC, DT, DA)
    mbb = _m_block(m_ptr, rowb, okb, b, okb, BT)
    to_rows = tl.exp(tl.where(mkb, (Gb - Gr[None, :]).to(tl.float32), float("-inf")))
    if FACTORED and _span(Gb, Gr, mkb) <= SPAN_MAX:
        xsd = _block_tile(x_ptr, rowb, mkb, kc, K) * tl.exp(
            tl.where(mkb, (Gr[None, :] - Gb).to(tl.float32), float("-inf")))
        tri = (r16[:, None] > r16[None, :]) if STRICT else (r16[:, None] >= r16[None, :])
        acc = (acc + _mm(tl.where(tri, mbb, 0.0), xsd, PREC, DT, DA)) * to_rows
    else:
        acc = _gated_rows_diagonal(acc * to_rows, mbb, x_ptr, G_ptr, Gb, okb, bos, eos, b, H, hh, K, BK, STRICT)
    return acc


@triton.jit
def _gated_rows_diagonal(acc, mbb, x_ptr, G_ptr, Gb, okb, bos, eos, b: tl.constexpr, H, hh, K: tl.constexpr,
                         BK: tl.constexpr, STRICT: tl.constexpr):
    """R's diagonal block with the exact pairwise exponents, one column s at a time."""
    r16 = tl.arange(0, 16)
    kc = tl.arange(0, BK)
    for s in range(16):  # a run-time loop: unrolled, the sixteen [16, K] updates cost compile time and registers
        ts = bos + b * 16 + s
        rs = ts.to(tl.int64) * H + hh
        ks = (ts < eos) & (kc < K)
        xrow = tl.load(x_ptr + rs * K + kc, mask=ks, other=0.0).to(tl.float32)
        Gs = tl.load(G_ptr + rs * K + kc, mask=ks, other=0.0)
        mcol = tl.sum(tl.where(r16[None, :] == s, mbb, 0.0), 1)  # M[:, s] of the block
        keep = (((r16 > s) if STRICT else (r16 >= s)) & okb)[:, None] & ks[None, :]
        acc += mcol[:, None] * xrow[None, :] * tl.exp(tl.where(keep, (Gb - Gs[None, :]).to(tl.float32), float("-inf")))
    return acc


# lint: allow-function TP001,TP007 -- [16, K] block tiles and [16, 16] blocks of M inside a chunk of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _gated_cols(m_ptr, y_ptr, ys_ptr, G_ptr, bos, eos, b: tl.constexpr, H, hh, K: tl.constexpr, BK: tl.constexpr,
                BT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr, YSCALE: tl.constexpr,
                STRICT: tl.constexpr, FACTORED: tl.constexpr, SPAN_MAX: tl.constexpr):
    """C(M, Y) for the columns of block b (rows s of the result): [16, BK] fp32. YSCALE: Y's rows
    are scaled by ys_ptr's [Ntok, H] values first (C(diag(beta) M, K) = C(M, diag(beta) K)).
    STRICT: without the diagonal terms t = s. A later block i > b goes through its own first row
    r: exp(G_r - G_s) (M^T (Y_t exp(G_t - G_r))), both factors <= 1; the diagonal block as in
    `_gated_rows` (through block b's first row when FACTORED and the span allows)."""
    NB: tl.constexpr = BT // 16
    r16 = tl.arange(0, 16)
    kc = tl.arange(0, BK)
    okb, rowb, mkb = _block_rows(bos, eos, b, H, hh, kc, K)
    Gb, Gr, r_ok = _block_gates(G_ptr, bos, eos, b, H, hh, rowb, mkb, kc, K)
    acc = tl.full([16, BK], 0.0, tl.float32)
    for i in tl.static_range(b + 1, NB):
        oki, rowi, mki = _block_rows(bos, eos, i, H, hh, kc, K)
        Gi, Gri, ri_ok = _block_gates(G_ptr, bos, eos, i, H, hh, rowi, mki, kc, K)
        yi = _block_tile(y_ptr, rowi, mki, kc, K)
        if YSCALE:
            yi = yi * tl.load(ys_ptr + rowi, mask=oki, other=0.0).to(tl.float32)[:, None]
        ys = yi * tl.exp(tl.where(mki, (Gi - Gri[None, :]).to(tl.float32), float("-inf")))
        decay = tl.exp(tl.where(mkb & ri_ok, (Gri[None, :] - Gb).to(tl.float32), float("-inf")))
        acc += decay * _mm(tl.trans(_m_block(m_ptr, rowi, oki, b, okb, BT)), ys, PREC, DT, DA)
    mbb = _m_block(m_ptr, rowb, okb, b, okb, BT)  # [t, s]
    if FACTORED and _span(Gb, Gr, mkb) <= SPAN_MAX:
        yb = _block_tile(y_ptr, rowb, mkb, kc, K)
        if YSCALE:
            yb = yb * tl.load(ys_ptr + rowb, mask=okb, other=0.0).to(tl.float32)[:, None]
        ysd = yb * tl.exp(tl.where(mkb, (Gb - Gr[None, :]).to(tl.float32), float("-inf")))
        tri = (r16[:, None] > r16[None, :]) if STRICT else (r16[:, None] >= r16[None, :])
        acc += _mm(tl.trans(tl.where(tri, mbb, 0.0)), ysd, PREC, DT, DA) * tl.exp(
            tl.where(mkb, (Gr[None, :] - Gb).to(tl.float32), float("-inf")))
    else:
        acc = _gated_cols_diagonal(acc, mbb, y_ptr, ys_ptr, G_ptr, Gb, okb, bos, eos, b, H, hh, K, BK, YSCALE, STRICT)
    return acc


@triton.jit
def _gated_cols_diagonal(acc, mbb, y_ptr, ys_ptr, G_ptr, Gb, okb, bos, eos, b: tl.constexpr, H, hh,
                         K: tl.constexpr, BK: tl.constexpr, YSCALE: tl.constexpr, STRICT: tl.constexpr):
    """C's diagonal block with the exact pairwise exponents, one row t at a time."""
    r16 = tl.arange(0, 16)
    kc = tl.arange(0, BK)
    for t in range(16):
        tt = bos + b * 16 + t
        rt = tt.to(tl.int64) * H + hh
        kt = (tt < eos) & (kc < K)
        yrow = tl.load(y_ptr + rt * K + kc, mask=kt, other=0.0).to(tl.float32)
        if YSCALE:
            yrow = yrow * tl.load(ys_ptr + rt, mask=tt < eos, other=0.0).to(tl.float32)
        Gt = tl.load(G_ptr + rt * K + kc, mask=kt, other=0.0)
        mrow = tl.sum(tl.where(r16[:, None] == t, mbb, 0.0), 0)  # M[t, :] of the block
        keep = (((r16 < t) if STRICT else (r16 <= t)) & okb)[:, None] & kt[None, :]
        acc += mrow[:, None] * yrow[None, :] * tl.exp(tl.where(keep, (Gt[None, :] - Gb).to(tl.float32), float("-inf")))
    return acc


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _kda_dv_local_chunk(q_ptr, k_ptr, G_ptr, do_ptr, dvl_ptr, bos, eos, H, hh, vc, scale, K: tl.constexpr,
                        V: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                        DA: tl.constexpr, L2NORM_QK: tl.constexpr = False, eps=1e-6):
    """7 for a whole chunk whose gates span at most 60 about its middle row m (the recompute left
    its flag clear): P^T = upper((K * exp(G_m - G)) (Q * exp(G - G_m))^T) [s, t], formed as keys
    times queries (never tl.trans of a dot result: the miscompile GDN's stage 9 avoids), then
    dVl = scale P^T dO for this V block; the products at the backward's PREC (`_mm`). L2NORM_QK:
    q and k are the raw inputs and each row is normalised here in fp32 (x rsqrt(sum x^2 + eps), the
    fp32 values `l2norm_fwd` stores for the other stages, up to the sum's order): 16-bit rows read
    instead of fp32 ones (DV_LOCAL_RAW_QK)."""
    r = tl.arange(0, BT)
    kc = tl.arange(0, BK)
    valid, row, mk = _block_rows(bos, eos, 0, H, hh, kc, K, BT)
    d, _ = _chunk_gate_offsets(G_ptr, row, mk, bos, eos, H, hh, kc, K, BT)
    kt = _block_tile(k_ptr, row, mk, kc, K)
    qt = _block_tile(q_ptr, row, mk, kc, K)
    if L2NORM_QK:  # BK covers K: whole rows (rows past the sequence are 0 and stay 0)
        kt = kt * tl.rsqrt(tl.sum(kt * kt, 1) + eps)[:, None]
        qt = qt * tl.rsqrt(tl.sum(qt * qt, 1) + eps)[:, None]
    ks = kt * tl.exp(-d)
    xq = qt * tl.exp(d)
    Pt = _mm(ks, tl.trans(xq), PREC, DT, DA)
    Pt = tl.where((r[:, None] <= r[None, :]) & valid[:, None] & valid[None, :], Pt, 0.0)
    mv = valid[:, None] & (vc < V)[None, :]
    do = tl.load(do_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
    tl.store(dvl_ptr + row[:, None] * V + vc[None, :], _mm(Pt, do, PREC, DT, DA) * scale, mask=mv)


# lint: allow-function TP001,TP007 -- [16, K] block tiles and [16, 16] blocks of M inside a chunk of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _scores_t(q_ptr, kj, Gj, mkj, rowi, mki, Gi, Gr, r_ok, kc, K: tl.constexpr, PREC: tl.constexpr,
              DT: tl.constexpr, DA: tl.constexpr):
    """P^T for key block j against query block i through block i's first row r: [16 (s), 16 (t)] =
    (K_j exp(G_r - G_j)) (Q_i exp(G_i - G_r))^T, formed as its own product (keys times queries),
    never as tl.trans of a dot result (see GDN's stage 9)."""
    xq = _block_tile(q_ptr, rowi, mki, kc, K) * tl.exp(tl.where(mki, (Gi - Gr[None, :]).to(tl.float32), float("-inf")))
    ks = kj * tl.exp(tl.where(mkj & r_ok, (Gr[None, :] - Gj).to(tl.float32), float("-inf")))
    return _mm(ks, tl.trans(xq), PREC, DT, DA)


@triton.jit
def _chunk_of(chunks_ptr, c, H, hh, BT: tl.constexpr):
    """Chunk c of head hh as `_chunk_program` describes a grid's item: its tokens [bos, eos), the
    positions r in the chunk, the tokens, which are valid, and their [Ntok, H] row offsets."""
    bos = tl.load(chunks_ptr + 2 * c)
    eos = tl.load(chunks_ptr + 2 * c + 1)
    r = tl.arange(0, BT)
    tok = bos + r
    return bos, eos, r, tok, tok < eos, tok.to(tl.int64) * H + hh


# lint: allow-function TP001,TP007 -- [16, K] block tiles and [16, 16] blocks of M inside a chunk of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _kda_dv_local_kernel(q_ptr, k_ptr, G_ptr, do_ptr, dvl_ptr, chunks_ptr, H, scale,
                         K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                         BT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr,
                         FACTORED: tl.constexpr = False, SPAN_MAX: tl.constexpr = 40.0,
                         CHUNKS: tl.constexpr = "all", flags_ptr=None, work_ptr=None,
                         L2NORM_QK: tl.constexpr = False, eps=1e-6):
    """7 (per-channel gates): dVl = scale P^T dO, P_ts = sum_c q_tc k_sc exp(G_tc - G_sc) (t >= s),
    by 16-row blocks: dVl_j = sum_{i >= j} P_ij^T dO_i; grid (NC * V/BV, H). P_ij^T through block
    i's first row (`_scores_t`) for i > j and, with FACTORED, for a diagonal block whose gates span
    at most SPAN_MAX (the forward's FACTORED_DIAGONAL); the exact pairwise form otherwise.
    CHUNKS as the output kernel's (DIAGONAL_FORM "chunk", the recompute's flags at flags_ptr):
    "whole" forms the unflagged chunks whole (`_kda_dv_local_chunk`), "flagged" the others by
    blocks, "worklist" the same from their worklist at work_ptr on a persistent grid. L2NORM_QK
    ("whole" only): q and k raw, normalised where loaded (`_kda_dv_local_chunk`)."""
    tl.static_assert(CHUNKS == "whole" or not L2NORM_QK, "raw q and k on the whole-chunk route only")
    if CHUNKS == "worklist":
        i = tl.program_id(0)
        n = tl.load(work_ptr) * NV
        while i < n:  # a while loop, as 9b's
            item = tl.load(work_ptr + 1 + i // NV)
            jv = i % NV
            i += tl.num_programs(0)
            _kda_dv_local_blocks(item // H, jv, item % H, q_ptr, k_ptr, G_ptr, do_ptr, dvl_ptr, chunks_ptr, H, scale,
                                 K, V, BK, BV, BT, PREC, DT, DA, FACTORED, SPAN_MAX)
    elif not _not_this_route(CHUNKS, flags_ptr, tl.program_id(0) // NV, H, tl.program_id(1)):
        c = tl.program_id(0) // NV
        hh = tl.program_id(1)
        vc = (tl.program_id(0) % NV) * BV + tl.arange(0, BV)
        if CHUNKS == "whole":
            _kda_dv_local_chunk(q_ptr, k_ptr, G_ptr, do_ptr, dvl_ptr, tl.load(chunks_ptr + 2 * c),
                                tl.load(chunks_ptr + 2 * c + 1), H, hh, vc, scale, K, V, BK, BT, PREC, DT, DA,
                                L2NORM_QK, eps)
        else:
            _kda_dv_local_blocks(c, tl.program_id(0) % NV, hh, q_ptr, k_ptr, G_ptr, do_ptr, dvl_ptr, chunks_ptr, H,
                                 scale, K, V, BK, BV, BT, PREC, DT, DA, FACTORED, SPAN_MAX)


# lint: allow-function TP001,TP007 -- [16, K] block tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6)
@triton.jit
def _kda_dv_local_blocks(c, jv, hh, q_ptr, k_ptr, G_ptr, do_ptr, dvl_ptr, chunks_ptr, H, scale,
                         K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                         PREC: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr, FACTORED: tl.constexpr,
                         SPAN_MAX: tl.constexpr):
    """7 for chunk c of head hh, value columns block jv, by 16-row blocks (`_kda_dv_local_kernel`'s)."""
    NB: tl.constexpr = BT // 16
    bos = tl.load(chunks_ptr + 2 * c)
    eos = tl.load(chunks_ptr + 2 * c + 1)
    r16 = tl.arange(0, 16)
    kc = tl.arange(0, BK)
    vc = jv * BV + tl.arange(0, BV)
    for jb in tl.static_range(NB):
        okj, rowj, mkj = _block_rows(bos, eos, jb, H, hh, kc, K)
        Gj, Grj, rj_ok = _block_gates(G_ptr, bos, eos, jb, H, hh, rowj, mkj, kc, K)
        kj = _block_tile(k_ptr, rowj, mkj, kc, K)
        acc = tl.full([16, BV], 0.0, tl.float32)
        for ib in tl.static_range(jb, NB):
            oki, rowi, mki = _block_rows(bos, eos, ib, H, hh, kc, K)
            doi = tl.load(do_ptr + rowi[:, None] * V + vc[None, :], mask=oki[:, None] & (vc < V)[None, :],
                          other=0.0).to(tl.float32)
            if ib == jb:
                if FACTORED and _span(Gj, Grj, mkj) <= SPAN_MAX:
                    Pt = tl.where(r16[:, None] <= r16[None, :],
                                  _scores_t(q_ptr, kj, Gj, mkj, rowj, mkj, Gj, Grj, rj_ok, kc, K, PREC, DT, DA), 0.0)
                else:
                    Pt = tl.full([16, 16], 0.0, tl.float32)  # [s, t]
                    for t in range(16):
                        tt = bos + jb * 16 + t
                        rt = tt.to(tl.int64) * H + hh
                        mt = (tt < eos) & (kc < K)
                        qrow = tl.load(q_ptr + rt * K + kc, mask=mt, other=0.0).to(tl.float32)
                        Gt = tl.load(G_ptr + rt * K + kc, mask=mt, other=0.0)
                        keep = ((r16 <= t) & okj)[:, None] & mt[None, :]
                        col = tl.sum(kj * qrow[None, :] * tl.exp(tl.where(keep, (Gt[None, :] - Gj).to(tl.float32),
                                                                            float("-inf"))), 1)
                        Pt += tl.where(r16[None, :] == t, col[:, None], 0.0)
            else:
                Gi, Gri, ri_ok = _block_gates(G_ptr, bos, eos, ib, H, hh, rowi, mki, kc, K)
                Pt = _scores_t(q_ptr, kj, Gj, mkj, rowi, mki, Gi, Gri, ri_ok, kc, K, PREC, DT, DA)
            acc += _mm(Pt, doi, PREC, DT, DA)
        tl.store(dvl_ptr + rowj[:, None] * V + vc[None, :], acc * scale, mask=okj[:, None] & (vc < V)[None, :])


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _kda_dqkwg_kernel(q_ptr, k_ptr, G_ptr, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr, dq_ptr, dk_ptr, dw_ptr, dG_ptr,
                      dp_ptr, chunks_ptr, H, scale,
                      K: tl.constexpr, V: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                      BT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr,
                      PAIRS: tl.constexpr = False, flags_ptr=None, dp_stride=0, CHUNKS: tl.constexpr = "all",
                      work_ptr=None):
    """9 (per-channel gates), per chunk, head and block of BKS key columns (grid (NC * K/BKS, H)),
    summing over V blocks:
        dQh = scale dO h_c^T,  dKd = Vn dh^T,  dW = -dVn h_c^T,  hdh = rowsum(h_c * dh) [K],
        dP = lower(scale dO Vn^T) (t >= s; stored [Ntok, H, 64] for 9b)
    (dh: the gradient of the state leaving the chunk), and the fp32 partials that 9b and 10 finish:
        dQ' = exp(G) * dQh;  dK' = exp(G_L - G) * dKd;  dG' = Q * dQ' - Kd * dKd  (Kd = exp(G_L - G) * K),
    the last valid row's dG' also + exp(G_L) * hdh + colsum(Kd * dKd). Every term is per key
    channel (unlike GDN's dG, no sum over channels), so the column blocks are independent; the block
    of columns 0 also forms and stores dP. Split as GDN's stage 9 is: whole K in one program spilled
    1620 B per thread at 8 warps (sm_90a).
    PAIRS (BACKWARD_FUSED_PAIRS holds "9b"): every block of columns forms dP and stores it to its
    own slice of dp_ptr (dp_stride apart; 9b's flagged launch reads slice 0), and a chunk stage 3
    left unflagged (flags_ptr) takes 9b's whole-chunk pair terms for this block's columns here,
    after a CTA barrier, from that slice (`_gated_pair_chunk` reads M^T from memory: never tl.trans
    of a dot result into a dot), before dQ', dK', dG' are stored once.
    CHUNKS "flagged": the flagged chunks only (another kernel took the others), "worklist" the same
    from their worklist at work_ptr on a persistent grid; "all" every chunk."""
    NK: tl.constexpr = (K + BKS - 1) // BKS
    if CHUNKS == "worklist":
        i = tl.program_id(0)
        n = tl.load(work_ptr) * NK
        while i < n:  # a while loop, as 9b's
            item = tl.load(work_ptr + 1 + i // NK)
            kb = i % NK
            i += tl.num_programs(0)
            _kda_dqkwg_program(item // H, item % H, kb, True, q_ptr, k_ptr, G_ptr, h_ptr, dh_ptr, vn_ptr, dvn_ptr,
                               do_ptr, dq_ptr, dk_ptr, dw_ptr, dG_ptr, dp_ptr, chunks_ptr, H, scale, K, V, BKS, BV, NV,
                               BT, PREC, DT, DA, PAIRS, flags_ptr, dp_stride)
    elif not _not_this_route(CHUNKS, flags_ptr, tl.program_id(0) // NK, H, tl.program_id(1)):
        _kda_dqkwg_program(tl.program_id(0) // NK, tl.program_id(1), tl.program_id(0) % NK, CHUNKS == "flagged",
                           q_ptr, k_ptr, G_ptr, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr, dq_ptr, dk_ptr, dw_ptr, dG_ptr,
                           dp_ptr, chunks_ptr, H, scale, K, V, BKS, BV, NV, BT, PREC, DT, DA, PAIRS, flags_ptr,
                           dp_stride)


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _kda_dqkwg_program(c, hh, kb, ONLY_FLAGGED: tl.constexpr, q_ptr, k_ptr, G_ptr, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr, dq_ptr, dk_ptr, dw_ptr,
                       dG_ptr, dp_ptr, chunks_ptr, H, scale, K: tl.constexpr, V: tl.constexpr, BKS: tl.constexpr,
                       BV: tl.constexpr, NV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                       DA: tl.constexpr, PAIRS: tl.constexpr, flags_ptr, dp_stride):
    """9 for chunk c of head hh, key columns block kb (`_kda_dqkwg_kernel`'s); ONLY_FLAGGED: the
    chunk is one stage 3 flagged (the flagged routes' launches), so the whole-chunk pair terms are
    compiled out (with them the worklist route spilled 388 B a thread against 16, sm_90a)."""
    bos, eos, r, tok, valid, row = _chunk_of(chunks_ptr, c, H, hh, BT)
    kc = kb * BKS + tl.arange(0, BKS)
    mk = valid[:, None] & (kc < K)[None, :]
    sbase = (c.to(tl.int64) * H + hh) * (K * V)
    dqh = tl.full([BT, BKS], 0.0, tl.float32)
    dkd = tl.full([BT, BKS], 0.0, tl.float32)
    dw = tl.full([BT, BKS], 0.0, tl.float32)
    dp = tl.full([BT, BT], 0.0, tl.float32)
    hdh = tl.full([BKS], 0.0, tl.float32)
    for j in tl.static_range(NV):
        vc = j * BV + tl.arange(0, BV)
        mv = valid[:, None] & (vc < V)[None, :]
        smask = (kc < K)[:, None] & (vc < V)[None, :]
        h = tl.load(h_ptr + sbase + kc[:, None] * V + vc[None, :], mask=smask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + sbase + kc[:, None] * V + vc[None, :], mask=smask, other=0.0).to(tl.float32)
        vn = tl.load(vn_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
        dvn = tl.load(dvn_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
        dqh += _mm(do, tl.trans(h), PREC, DT, DA)
        dkd += _mm(vn, tl.trans(dh), PREC, DT, DA)
        dw -= _mm(dvn, tl.trans(h), PREC, DT, DA)
        if PAIRS:
            dp += _mm(do, tl.trans(vn), PREC, DT, DA)
        elif kb == 0:
            dp += _mm(do, tl.trans(vn), PREC, DT, DA)
        hdh += tl.sum(h * dh, 1)
    last = tl.minimum(bos + BT, eos) - 1
    GL = tl.load(G_ptr + (last.to(tl.int64) * H + hh) * K + kc, mask=kc < K, other=0.0)
    G = tl.load(G_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0)
    q = tl.load(q_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0).to(tl.float32)
    dqp = tl.exp(tl.where(mk, G.to(tl.float32), float("-inf"))) * dqh * scale
    decay = tl.exp(tl.where(mk, (GL[None, :] - G).to(tl.float32), float("-inf")))
    # x = Kd * dKd enters dG with - on its row and + (summed) on the last row; the last row's own
    # term (decay 1) is left out of both rather than cancelled (see 9b)
    x = tl.where((tok == last)[:, None], 0.0, k * decay * dkd)
    dG = q * dqp - x
    dG += tl.where((tok == last)[:, None], (tl.exp(GL.to(tl.float32)) * hdh + tl.sum(x, 0))[None, :], 0.0)
    offs = row[:, None] * K + kc[None, :]
    tl.store(dw_ptr + offs, dw, mask=mk)
    dkp = decay * dkd
    lower = valid[:, None] & valid[None, :] & (r[:, None] >= r[None, :])
    if PAIRS:
        dpl = tl.where(lower, dp * scale, 0.0)
        dp_slice = dp_ptr + kb.to(tl.int64) * dp_stride
        whole = False if ONLY_FLAGGED else tl.load(flags_ptr + c * H + hh) == 0
        # read back here by an unflagged chunk's every block; a flagged chunk's slice 0 by 9b's launch
        tl.store(dp_slice + row[:, None] * BT + r[None, :], dpl, mask=valid[:, None] & (whole | (kb == 0)))
        if whole:
            tl.debug_barrier()  # every warp's rows of dP stored before any warp reads its columns
            # q, k and G loaded again (from L1/L2) rather than the ones above: using those spilled
            # 16-28 B more per thread (sm_90a, K = V = 128); M^T from memory (see above)
            R, C = _gated_pair_chunk(dp_slice, k_ptr, q_ptr, q_ptr, G_ptr, bos, eos, H, hh, kc, K, BT, PREC, DT, DA,
                                     False)
            d = tl.sum(tl.where(r[:, None] == r[None, :], dpl, 0.0), 1)  # dP_tt
            # summed in 9b's order (`_dp_apply_rows`)
            dqp = dqp + R + d[:, None] * k
            dkp = dkp + C + d[:, None] * q
            dG = dG + q * R - k * C
    elif kb == 0:
        tl.store(dp_ptr + row[:, None] * BT + r[None, :], tl.where(lower, dp * scale, 0.0), mask=valid[:, None])
    tl.store(dq_ptr + offs, dqp, mask=mk)
    tl.store(dk_ptr + offs, dkp, mask=mk)
    tl.store(dG_ptr + offs, dG, mask=mk)


# lint: allow-function TP001,TP007 -- [16, K] block tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6)
@triton.jit
def _kda_dp_apply_kernel(dp_ptr, q_ptr, k_ptr, G_ptr, dq_ptr, dk_ptr, dG_ptr, chunks_ptr, H,
                         K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                         DA: tl.constexpr, FACTORED: tl.constexpr = False, SPAN_MAX: tl.constexpr = 40.0,
                         CHUNKS: tl.constexpr = "all", flags_ptr=None, WHOLE_BK: tl.constexpr = 64, work_ptr=None):
    """9b: the pair terms of dQ, dK and dG from 9's dP, in place on 9's fp32 partials, one 16-row
    block at a time (grid (NC, H)): with R = R(dP, K) and C = C(dP, Q) over s < t (strict) and
    d = the diagonal of dP,
        dQ' += R + d * K,   dK' += C + d * Q,   dG' += Q * R - K * C.
    The diagonal's terms of dG (q_t k_t dP_tt, once with each sign) are left out rather than
    cancelled: their rounding noise swamps dg where it is tiny (gates of -20 and below), as in GDN.
    CHUNKS as the output kernel's (DIAGONAL_FORM "chunk", the recompute's flags at flags_ptr):
    "whole" takes R and C for the unflagged chunks at once (`_gated_pair_chunk`), "flagged" the
    others block by block, and "worklist" the same from their worklist at work_ptr on a persistent
    grid (`_flagged_items`)."""
    if CHUNKS == "worklist":
        i = tl.program_id(0)
        n = tl.load(work_ptr)
        while i < n:  # a while loop, as the forward's flagged routes (a for loop spilled there)
            item = tl.load(work_ptr + 1 + i)
            i += tl.num_programs(0)
            _kda_dp_apply_program(item // H, item % H, dp_ptr, q_ptr, k_ptr, G_ptr, dq_ptr, dk_ptr, dG_ptr,
                                  chunks_ptr, H, K, BK, BT, PREC, DT, DA, FACTORED, SPAN_MAX, False, WHOLE_BK)
    elif not _not_this_route(CHUNKS, flags_ptr, tl.program_id(0), H, tl.program_id(1)):
        _kda_dp_apply_program(tl.program_id(0), tl.program_id(1), dp_ptr, q_ptr, k_ptr, G_ptr, dq_ptr, dk_ptr, dG_ptr,
                              chunks_ptr, H, K, BK, BT, PREC, DT, DA, FACTORED, SPAN_MAX, CHUNKS == "whole", WHOLE_BK)


# lint: allow-function TP001,TP007 -- [16, K] block tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6)
@triton.jit
def _kda_dp_apply_program(c, hh, dp_ptr, q_ptr, k_ptr, G_ptr, dq_ptr, dk_ptr, dG_ptr, chunks_ptr, H,
                          K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                          DA: tl.constexpr, FACTORED: tl.constexpr, SPAN_MAX: tl.constexpr, WHOLE: tl.constexpr,
                          WHOLE_BK: tl.constexpr):
    """9b for chunk c of head hh (`_kda_dp_apply_kernel`'s): whole (WHOLE) or block by block."""
    NB: tl.constexpr = BT // 16
    bos = tl.load(chunks_ptr + 2 * c)
    eos = tl.load(chunks_ptr + 2 * c + 1)
    kc = tl.arange(0, BK)
    if WHOLE:  # by blocks of key channels: every term is per channel but M
        ok, rows, _ = _block_rows(bos, eos, 0, H, hh, kc, K, BT)
        for cb in tl.static_range(0, BK, WHOLE_BK):
            cc = cb + tl.arange(0, WHOLE_BK)
            R, C = _gated_pair_chunk(dp_ptr, k_ptr, q_ptr, q_ptr, G_ptr, bos, eos, H, hh, cc, K, BT, PREC, DT, DA,
                                     False)
            _dp_apply_rows(dp_ptr, q_ptr, k_ptr, dq_ptr, dk_ptr, dG_ptr, R, C, ok, rows, tl.arange(0, BT), cc, K, BT)
    else:
        for b in tl.static_range(NB):
            okb, rowb, mkb = _block_rows(bos, eos, b, H, hh, kc, K)
            R = _gated_rows(dp_ptr, k_ptr, G_ptr, bos, eos, b, H, hh, K, BK, BT, PREC, DT, DA, True, FACTORED,
                            SPAN_MAX)
            C = _gated_cols(dp_ptr, q_ptr, q_ptr, G_ptr, bos, eos, b, H, hh, K, BK, BT, PREC, DT, DA, False, True,
                            FACTORED, SPAN_MAX)
            _dp_apply_rows(dp_ptr, q_ptr, k_ptr, dq_ptr, dk_ptr, dG_ptr, R, C, okb, rowb, b * 16 + tl.arange(0, 16),
                           kc, K, BT)


# lint: allow-function TP001,TP007 -- [16 or 64, K] row tiles of [T, H, K] tensors updated in place: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _dp_apply_rows(dp_ptr, q_ptr, k_ptr, dq_ptr, dk_ptr, dG_ptr, R, C, ok, rows, cols, kc, K: tl.constexpr,
                   BT: tl.constexpr):
    """9b's update of a set of rows (a 16-row block or a whole chunk; `cols` their positions in the
    chunk) from their R and C: dQ' += R + d K, dK' += C + d Q, dG' += Q R - K C, d = diag(dP)."""
    mk = ok[:, None] & (kc < K)[None, :]
    offs = rows[:, None] * K + kc[None, :]
    qb = tl.load(q_ptr + offs, mask=mk, other=0.0).to(tl.float32)
    kb = tl.load(k_ptr + offs, mask=mk, other=0.0).to(tl.float32)
    d = tl.load(dp_ptr + rows * BT + cols, mask=ok, other=0.0)  # dP_tt
    tl.store(dq_ptr + offs, tl.load(dq_ptr + offs, mask=mk, other=0.0) + R + d[:, None] * kb, mask=mk)
    tl.store(dk_ptr + offs, tl.load(dk_ptr + offs, mask=mk, other=0.0) + C + d[:, None] * qb, mask=mk)
    tl.store(dG_ptr + offs, tl.load(dG_ptr + offs, mask=mk, other=0.0) + qb * R - kb * C, mask=mk)


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles and the chunk's [64, 64] M of [T, H, K] / [T, H, 64] tensors: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _gated_pair_chunk(m_ptr, x_ptr, y_ptr, ys_ptr, G_ptr, bos, eos, H, hh, kc, K: tl.constexpr,
                      BT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr,
                      YSCALE: tl.constexpr):
    """(R(M, X), C(M, Y)) over s < t (strict) for a whole chunk whose gates span at most 60 about
    its middle row m, for the key channels kc: each [BT, len(kc)] fp32 and one product; d = G - G_m,
        R = e^d * (M (X * e^-d)),   C = e^-d * (M^T (Y * e^d)),
    M from the chunk's [64, 64] rows at m_ptr (row t holds M_t), strictly lower; YSCALE: Y's rows
    scaled by ys_ptr's [Ntok, H] values first. The factors are finite; a kept term's two factors
    multiply back to its exact exponent, so no term is larger than the exact one."""
    valid, row, mk = _block_rows(bos, eos, 0, H, hh, kc, K, BT)
    d, _ = _chunk_gate_offsets(G_ptr, row, mk, bos, eos, H, hh, kc, K, BT)
    y = _block_tile(y_ptr, row, mk, kc, K)
    if YSCALE:
        y = y * tl.load(ys_ptr + row, mask=valid, other=0.0).to(tl.float32)[:, None]
    return _gated_pairs(_strict_lower_rows(m_ptr, row, valid, BT), _block_tile(x_ptr, row, mk, kc, K), y, d, PREC,
                        DT, DA)


# lint: allow-function TP001 -- the chunk's [64, 64] rows of an [Ntok, H, 64] scratch: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _strict_lower_rows(m_ptr, row, valid, BT: tl.constexpr):
    """The chunk's [BT, BT] rows at m_ptr ([Ntok, H, BT]: row t holds M_t) below the diagonal; 0
    elsewhere and past the chunk's valid rows. Loaded, not a dot result: `_gated_pairs` may
    transpose it into a product."""
    r = tl.arange(0, BT)
    keep = (r[:, None] > r[None, :]) & valid[:, None] & valid[None, :]
    return tl.load(m_ptr + row[:, None] * BT + r[None, :], mask=keep, other=0.0)


@triton.jit
def _gated_pairs(M, x, y, d, PREC: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr):
    """(R, C) = (e^d * (M (X * e^-d)), e^-d * (M^T (Y * e^d))) for loaded fp32 tiles: M strictly
    lower [BT, BT] (`_strict_lower_rows`), X, Y and d = G - G_m [BT, n] (0 off the chunk)."""
    R = _mm(M, x * tl.exp(-d), PREC, DT, DA) * tl.exp(d)
    C = _mm(tl.trans(M), y * tl.exp(d), PREC, DT, DA) * tl.exp(-d)
    return R, C


@triton.jit
def _exp_where(G, mask):
    """exp(G) in fp32 where mask is on, 0 elsewhere."""
    return tl.exp(tl.where(mask, G.to(tl.float32), float("-inf")))


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _kda_wy_bwd_kernel(k_ptr, v_ptr, beta_ptr, G_ptr, Ai_ptr, w_ptr, u_ptr, dw_ptr, dvn_ptr, dkp_ptr, dGp_ptr,
                       da_ptr, dbp_ptr, dv_ptr, chunks_ptr, H,
                       K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                       BT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr,
                       CB: tl.constexpr = 64, PAIRS: tl.constexpr = False, flags_ptr=None, dk_ptr=None,
                       dbeta_ptr=None, dg_ptr=None, CHUNKS: tl.constexpr = "all", work_ptr=None,
                       U_FREE: tl.constexpr = False):
    """10 (per-channel gates), first half, per chunk and head (grid (NC, H)): back through W, U and T,
        dXw = T^T dW,  dXu = T^T dVn,  dA = strict_lower(-(dXw W^T + dXu U^T))  (stored for 10b),
        dV = diag(beta) dXu,  dbeta' = rowsum(V * dXu) + rowsum(exp(G) * K * dXw)  (stored),
    and in place on 9's partials: dK' += diag(beta) exp(G) * dXw, dG' += diag(beta) exp(G) * K * dXw.
    The key channels go by blocks of CB (dXw is per channel; dA sums the blocks). The pair terms
    through A are 10b's. PAIRS (BACKWARD_FUSED_PAIRS holds "10b"): a chunk stage 3 left unflagged
    (flags_ptr) takes 10b's whole-chunk pair terms here instead, and this program writes its final
    dk, dg and dbeta: after dA is stored and a CTA barrier, each block of channels forms its dXw
    again (dW's block comes from L2) and, with R and C from dA (`_gated_pair_chunk`, which reads
    dA^T from memory rather than transposing a dot result), finishes as 10b's whole route does,
    beta (R + exp(G) dXw) standing for beta R + beta exp(G) dXw. 9's partials dK', dG' are then
    read once and never written back; flagged chunks run as without PAIRS, for 10b's flagged launch.
    CHUNKS "flagged": the flagged chunks only (another kernel took the others, e.g. the gluon
    backend's `_kda_wy_bwd_wgmma_kernel`), "worklist" the same from their worklist at work_ptr on a
    persistent grid; "all" every chunk. U_FREE (BACKWARD_U_FROM_T): U is never formed (u_ptr unread):
    dXu U^T = (dXu (diag(beta) V)^T) T^T, the value blocks' sum taken by T^T after them."""
    if CHUNKS == "worklist":
        i = tl.program_id(0)
        n = tl.load(work_ptr)
        while i < n:  # a while loop, as 9b's
            item = tl.load(work_ptr + 1 + i)
            i += tl.num_programs(0)
            _kda_wy_bwd_program(item // H, item % H, True, k_ptr, v_ptr, beta_ptr, G_ptr, Ai_ptr, w_ptr, u_ptr, dw_ptr,
                                dvn_ptr, dkp_ptr, dGp_ptr, da_ptr, dbp_ptr, dv_ptr, chunks_ptr, H, K, V, BK, BV, NV, BT,
                                PREC, DT, DA, CB, PAIRS, flags_ptr, dk_ptr, dbeta_ptr, dg_ptr, U_FREE)
    elif not _not_this_route(CHUNKS, flags_ptr, tl.program_id(0), H, tl.program_id(1)):
        _kda_wy_bwd_program(tl.program_id(0), tl.program_id(1), CHUNKS == "flagged", k_ptr, v_ptr, beta_ptr, G_ptr,
                            Ai_ptr, w_ptr, u_ptr, dw_ptr, dvn_ptr, dkp_ptr, dGp_ptr, da_ptr, dbp_ptr, dv_ptr, chunks_ptr,
                            H, K, V, BK, BV, NV, BT, PREC, DT, DA, CB, PAIRS, flags_ptr, dk_ptr, dbeta_ptr, dg_ptr,
                            U_FREE)


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _kda_wy_bwd_program(c, hh, ONLY_FLAGGED: tl.constexpr, k_ptr, v_ptr, beta_ptr, G_ptr, Ai_ptr, w_ptr, u_ptr, dw_ptr, dvn_ptr, dkp_ptr, dGp_ptr,
                        da_ptr, dbp_ptr, dv_ptr, chunks_ptr, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr, NV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                        DA: tl.constexpr, CB: tl.constexpr, PAIRS: tl.constexpr, flags_ptr, dk_ptr, dbeta_ptr,
                        dg_ptr, U_FREE: tl.constexpr = False):
    """10's first half for chunk c of head hh (`_kda_wy_bwd_kernel`'s); ONLY_FLAGGED: the chunk is
    one stage 3 flagged (the flagged routes' launches), so the whole-chunk pair terms are compiled out."""
    bos, eos, r, tok, valid, row = _chunk_of(chunks_ptr, c, H, hh, BT)
    flagged = True
    if PAIRS and not ONLY_FLAGGED:
        flagged = tl.load(flags_ptr + c * H + hh) != 0
    Tm = tl.load(Ai_ptr + row[:, None] * BT + r[None, :], mask=valid[:, None], other=0.0)
    Tt = tl.trans(Tm)
    beta = tl.load(beta_ptr + row, mask=valid, other=0.0).to(tl.float32)
    dA = tl.full([BT, BT], 0.0, tl.float32)
    kdx = tl.full([BT], 0.0, tl.float32)  # rowsum(exp(G) * K * dXw), the unfused route's part of dbeta'
    for cb in tl.static_range(0, BK, CB):
        cc = cb + tl.arange(0, CB)
        mc = valid[:, None] & (cc < K)[None, :]
        offs = row[:, None] * K + cc[None, :]
        dxw = _mm(Tt, tl.load(dw_ptr + offs, mask=mc, other=0.0), PREC, DT, DA)
        dA -= _mm(dxw, tl.trans(tl.load(w_ptr + offs, mask=mc, other=0.0).to(tl.float32)), PREC, DT, DA)
        if flagged:
            k = tl.load(k_ptr + offs, mask=mc, other=0.0).to(tl.float32)
            egx = _exp_where(tl.load(G_ptr + offs, mask=mc, other=0.0), mc) * dxw
            kdx += tl.sum(k * egx, 1)
            tl.store(dkp_ptr + offs, tl.load(dkp_ptr + offs, mask=mc, other=0.0) + beta[:, None] * egx, mask=mc)
            tl.store(dGp_ptr + offs, tl.load(dGp_ptr + offs, mask=mc, other=0.0) + beta[:, None] * k * egx, mask=mc)
    vdu = tl.full([BT], 0.0, tl.float32)
    dAu = tl.full([BT, BT], 0.0, tl.float32)  # U_FREE: dXu (diag(beta) V)^T, summed over the value blocks
    for j in tl.static_range(NV):
        vc = j * BV + tl.arange(0, BV)
        mv = valid[:, None] & (vc < V)[None, :]
        dvn = tl.load(dvn_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
        dxu = _mm(Tt, dvn, PREC, DT, DA)
        tl.store(dv_ptr + row[:, None] * V + vc[None, :], (dxu * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=mv)
        v = tl.load(v_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
        vdu += tl.sum(v * dxu, 1)
        if U_FREE:
            dAu += _mm(dxu, tl.trans(v * beta[:, None]), PREC, DT, DA)
        else:
            u = tl.load(u_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
            dA -= _mm(dxu, tl.trans(u), PREC, DT, DA)
    if U_FREE:
        dA -= _mm(dAu, Tt, PREC, DT, DA)  # dXu U^T = (dXu Bv^T) T^T
    strict = valid[:, None] & valid[None, :] & (r[:, None] > r[None, :])
    tl.store(da_ptr + row[:, None] * BT + r[None, :], tl.where(strict, dA, 0.0), mask=valid[:, None])
    if not PAIRS:
        tl.store(dbp_ptr + row, vdu + kdx, mask=valid)
    elif flagged:
        tl.store(dbp_ptr + row, vdu + kdx, mask=valid)
    else:
        tl.debug_barrier()  # every warp's rows of dA stored before any warp reads its columns
        M = _strict_lower_rows(da_ptr, row, valid, BT)  # loaded, so its transpose may feed a product
        kr = tl.full([BT], 0.0, tl.float32)
        for cb in tl.static_range(0, BK, CB):
            cc = cb + tl.arange(0, CB)
            mc = valid[:, None] & (cc < K)[None, :]
            offs = row[:, None] * K + cc[None, :]
            Gc = tl.load(G_ptr + offs, mask=mc, other=0.0)
            # dXw again for this block (dW's block from L2): holding both blocks' dXw spilled
            egx = _exp_where(Gc, mc) * _mm(Tt, tl.load(dw_ptr + offs, mask=mc, other=0.0), PREC, DT, DA)
            k = tl.load(k_ptr + offs, mask=mc, other=0.0).to(tl.float32)
            Gm = _chunk_middle_gates(G_ptr, bos, eos, H, hh, cc, K, BT)
            R, C = _gated_pairs(M, k, k * beta[:, None], tl.where(mc, (Gc - Gm[None, :]).to(tl.float32), 0.0), PREC,
                                DT, DA)
            kr += _da_apply_rows(k_ptr, beta_ptr, dkp_ptr, dGp_ptr, dk_ptr, dg_ptr, R + egx, C,
                                 tl.full([CB], 0.0, tl.float32), valid, row, cc, K)[1]
        tl.store(dbeta_ptr + row, (vdu + kr).to(dbeta_ptr.dtype.element_ty), mask=valid)


# lint: allow-function TP001,TP007 -- [16, K] block tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6)
@triton.jit
def _kda_da_apply_kernel(da_ptr, k_ptr, beta_ptr, G_ptr, dkp_ptr, dGp_ptr, dbp_ptr, dk_ptr, dbeta_ptr, dg_ptr,
                         chunks_ptr, H, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
                         DT: tl.constexpr, DA: tl.constexpr, FACTORED: tl.constexpr = False,
                         SPAN_MAX: tl.constexpr = 40.0, CHUNKS: tl.constexpr = "all", flags_ptr=None,
                         WHOLE_BK: tl.constexpr = 64, work_ptr=None):
    """10b: the pair terms through A = strict_lower(diag(beta) Gam(K, K)) and the final dK, dbeta,
    dg, one 16-row block at a time from the chunk's last (grid (NC, H)): with R = R(dA, K) and
    C = C(dA, diag(beta) K),
        dK = dK' + diag(beta) R + C,   dG = dG' + diag(beta) K * R - K * C,   dbeta = dbeta' + rowsum(K * R),
    and dg = the reverse in-chunk cumulative sum of dG per channel (a carry of the later blocks' sums).
    CHUNKS as 9b's: "whole" takes the unflagged chunks at once (`_gated_pair_chunk`, no carry),
    "flagged" the others block by block, "worklist" the same from their worklist at work_ptr."""
    if CHUNKS == "worklist":
        i = tl.program_id(0)
        n = tl.load(work_ptr)
        while i < n:  # a while loop, as 9b's
            item = tl.load(work_ptr + 1 + i)
            i += tl.num_programs(0)
            _kda_da_apply_program(item // H, item % H, da_ptr, k_ptr, beta_ptr, G_ptr, dkp_ptr, dGp_ptr, dbp_ptr,
                                  dk_ptr, dbeta_ptr, dg_ptr, chunks_ptr, H, K, BK, BT, PREC, DT, DA, FACTORED,
                                  SPAN_MAX, False, WHOLE_BK)
    elif not _not_this_route(CHUNKS, flags_ptr, tl.program_id(0), H, tl.program_id(1)):
        _kda_da_apply_program(tl.program_id(0), tl.program_id(1), da_ptr, k_ptr, beta_ptr, G_ptr, dkp_ptr, dGp_ptr,
                              dbp_ptr, dk_ptr, dbeta_ptr, dg_ptr, chunks_ptr, H, K, BK, BT, PREC, DT, DA, FACTORED,
                              SPAN_MAX, CHUNKS == "whole", WHOLE_BK)


# lint: allow-function TP001,TP007 -- [16, K] block tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6)
@triton.jit
def _kda_da_apply_program(c, hh, da_ptr, k_ptr, beta_ptr, G_ptr, dkp_ptr, dGp_ptr, dbp_ptr, dk_ptr, dbeta_ptr, dg_ptr,
                          chunks_ptr, H, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
                          DT: tl.constexpr, DA: tl.constexpr, FACTORED: tl.constexpr, SPAN_MAX: tl.constexpr,
                          WHOLE: tl.constexpr, WHOLE_BK: tl.constexpr):
    """10b for chunk c of head hh (`_kda_da_apply_kernel`'s): whole (WHOLE) or block by block."""
    NB: tl.constexpr = BT // 16
    bos = tl.load(chunks_ptr + 2 * c)
    eos = tl.load(chunks_ptr + 2 * c + 1)
    kc = tl.arange(0, BK)
    carry = tl.full([BK], 0.0, tl.float32)
    if WHOLE:  # by blocks of key channels, as 9b's; dbeta sums over all of them
        ok, rows, _ = _block_rows(bos, eos, 0, H, hh, kc, K, BT)
        kr = tl.full([BT], 0.0, tl.float32)
        for cb in tl.static_range(0, BK, WHOLE_BK):
            cc = cb + tl.arange(0, WHOLE_BK)
            R, C = _gated_pair_chunk(da_ptr, k_ptr, k_ptr, beta_ptr, G_ptr, bos, eos, H, hh, cc, K, BT, PREC, DT,
                                     DA, True)
            kr += _da_apply_rows(k_ptr, beta_ptr, dkp_ptr, dGp_ptr, dk_ptr, dg_ptr, R, C,
                                 tl.full([WHOLE_BK], 0.0, tl.float32), ok, rows, cc, K)[1]
        tl.store(dbeta_ptr + rows, (tl.load(dbp_ptr + rows, mask=ok, other=0.0) + kr).to(dbeta_ptr.dtype.element_ty),
                 mask=ok)
    else:
        for b in tl.static_range(NB - 1, -1, -1):
            okb, rowb, mkb = _block_rows(bos, eos, b, H, hh, kc, K)
            R = _gated_rows(da_ptr, k_ptr, G_ptr, bos, eos, b, H, hh, K, BK, BT, PREC, DT, DA, True, FACTORED,
                            SPAN_MAX)
            C = _gated_cols(da_ptr, k_ptr, beta_ptr, G_ptr, bos, eos, b, H, hh, K, BK, BT, PREC, DT, DA, True, True,
                            FACTORED, SPAN_MAX)
            carry, kr = _da_apply_rows(k_ptr, beta_ptr, dkp_ptr, dGp_ptr, dk_ptr, dg_ptr, R, C, carry, okb, rowb, kc, K)
            tl.store(dbeta_ptr + rowb,
                     (tl.load(dbp_ptr + rowb, mask=okb, other=0.0) + kr).to(dbeta_ptr.dtype.element_ty), mask=okb)


# lint: allow-function TP001,TP007 -- [16 or 64, K] row tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 6), and varlen tails would need a descriptor per sequence
@triton.jit
def _da_apply_rows(k_ptr, beta_ptr, dkp_ptr, dGp_ptr, dk_ptr, dg_ptr, R, C, carry, ok, rows, kc, K: tl.constexpr):
    """10b's final dK and dg for a set of rows (a 16-row block, the chunk's later ones summed in
    `carry`, or a whole chunk) and key channels kc, from their R and C. Returns the carry for the
    rows before and rowsum(K * R) over kc, dbeta's pair term (the caller stores dbeta)."""
    mk = ok[:, None] & (kc < K)[None, :]
    offs = rows[:, None] * K + kc[None, :]
    kb = tl.load(k_ptr + offs, mask=mk, other=0.0).to(tl.float32)
    bb_ = tl.load(beta_ptr + rows, mask=ok, other=0.0).to(tl.float32)
    dk = tl.load(dkp_ptr + offs, mask=mk, other=0.0) + bb_[:, None] * R + C
    dG = tl.load(dGp_ptr + offs, mask=mk, other=0.0) + bb_[:, None] * kb * R - kb * C
    dg = tl.cumsum(dG, 0, reverse=True) + carry[None, :]
    tl.store(dk_ptr + offs, dk.to(dk_ptr.dtype.element_ty), mask=mk)
    tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=mk)
    return carry + tl.sum(dG, 0), tl.sum(kb * R, 1)


# ----------------------------------------------------------------------------------------
# backward stage functions (host): one kernel launch each
# ----------------------------------------------------------------------------------------

# 4 warps for the block-by-block kernels (7, 9b, 10b: 0-240 B of spills per thread, sm_90a); 8 for
# the whole-chunk ones, 9 (three [64, 64] fp32 accumulators and dP: 2204 B of spills at 4 warps,
# 596 at 8) and 10 (1424 -> 336 B)
_LAUNCH_BACKWARD = dict(num_warps=4)
# Whether the backward under DIAGONAL_FORM "chunk" takes whole chunks too (the recompute's stage 3,
# 7, 9b and 10b; docs/perf/kda.md rows 8-10) or the "factored" 16-row blocks throughout. On since
# the H200 A/B at 7e672c1 (scripts/kda_ab.py, S1, one run): 21.097 -> 12.932 ms with logsigmoid
# gates (gradients as far from the exact form's as the blocks', 2.05e-3), 35.9 -> 37.2 with every
# gate at -20..-30 (every chunk flagged: the tile kernels' span checks cost ~4% there).
BACKWARD_WHOLE_CHUNKS = True
# The warps of 7, 9b and 10b where they take whole chunks (DIAGONAL_FORM "chunk"): sm_90a, K = V = 128,
# bf16 inputs, 8 warps: 7 160 registers, no spills; 9b 255, 8 B; 10b 252, none (4 warps: 24, 1380 and
# 832 B of spills; 9b and 10b by blocks of 64 key channels, WHOLE_BK)
WHOLE_CHUNK_WARPS = 8
_LAUNCH_CHUNK = dict(num_warps=8)
# Which of the pair-term stages' whole-chunk routes run inside the kernel before them (with
# BACKWARD_WHOLE_CHUNKS): "9b" in 9 (`_kda_dqkwg_kernel`, PAIRS), "10b" in 10 (`_kda_wy_bwd_kernel`,
# PAIRS); the flagged chunks keep 9b's and 10b's block launches either way. Why: the first
# per-kernel profile of the backward (H200 at 26c97d1, S1) had 9 + 9b at 3.15 ms and 10 + 10b at
# 3.40 of 11.7, with 9's and 10's fp32 partials [Ntok, H, K] written, read and rewritten between
# them (docs/perf/kda.md rows 15 and 16).
BACKWARD_FUSED_PAIRS = ("9b", "10b")
# Stage 7's block of value columns on its whole-chunk route: 64 (two programs per chunk and head at
# V = 128, each forming the chunk's P^T from q, k and G again) or 128 (one: those reads halved; a
# [64, 128] accumulator). sm_90a, K = V = 128, 8 warps: see tests/test_triton_compile.py.
DV_LOCAL_WHOLE_BV = 128
# Whether stage 7's whole-chunk launch reads the raw q and k (16-bit inputs: 268 MB at S1) and
# normalises each row itself in fp32, instead of the fp32 copies `l2norm_fwd` made for the other
# stages (537 MB): the same values up to a row sum's order. Why: the H200's kda_ab "normalised-qk"
# (twenty-sixth session, row 37) timed this launch at 0.644 ms on fp32 q and k and 0.418 on bf16
# ones; the other stages keep their fp32 copies (stage 8's Gluon kernel takes no other). On since
# the twenty-seventh session (docs/perf/kda.md row 38): the H200 timed the launch 0.647 -> 0.607 ms
# at S1 (its own row norms cost most of what the halved reads save; 0.22 was predicted), the
# backward 5.824 -> 5.785, the gradients bitwise equal there. Read at each call.
DV_LOCAL_RAW_QK = True
_FUSABLE_PAIRS = ("9b", "10b")


def _fused_pairs() -> tuple:
    for name in BACKWARD_FUSED_PAIRS:
        _checked("BACKWARD_FUSED_PAIRS", name, _FUSABLE_PAIRS, what="stages")
    return tuple(BACKWARD_FUSED_PAIRS)


def chunk_dv_local_kda(q, k, G, do, scale: float, plan, input_dtype: torch.dtype, span_flags=None, worklist=None,
                       raw_qk=None, dvl=None):
    """7: dVl [Ntok, H, V] fp32. span_flags: the recompute's per-chunk flags (DIAGONAL_FORM
    "chunk"): the chunks it left unflagged are formed whole. worklist: the flags' `flagged_worklist`
    (BACKWARD_FLAGGED_WORKLIST), which the flagged chunks' launch then takes on a persistent grid.
    raw_qk: the caller's (q, k) before `l2norm_fwd` normalised them into q and k (fp32): the whole
    chunks' launch reads these and normalises them itself (DV_LOCAL_RAW_QK), the flagged chunks'
    launch the normalised ones. dvl: a buffer whose unflagged chunks another kernel has written
    (the gluon backend's `chunk_dv_local_kda_gluon`): only the flagged chunks' launch runs, into it."""
    Ntok, H, K = q.shape
    V = do.shape[-1]
    BK, BV, NV = _blocks(K, V)
    only_flagged = dvl is not None
    if only_flagged and span_flags is None:
        raise ValueError("chunk_dv_local_kda(dvl=...) writes the flagged chunks only: it needs span_flags")
    dvl = dvl if only_flagged else new_empty((Ntok, H, V), _F32, q.device)
    if plan.NC:
        DT, DA, PREC = _products(input_dtype, True)

        def args(bv: int) -> tuple:
            return (q, k, G, do, dvl, plan.chunks, H, scale, K, V, BK, bv, cdiv(V, bv), BT, PREC, DT, DA,
                    _factored_diagonal())

        # the whole chunks on their own block of value columns, from the raw q and k where given
        BVW = max(16, min(_checked("DV_LOCAL_WHOLE_BV", DV_LOCAL_WHOLE_BV, (16, 32, 64, 128)), next_pow2(V)))
        whole_args = args(BVW)
        whole_kwargs = {}
        if raw_qk is not None:
            whole_args = tuple(raw_qk) + whole_args[2:]
            whole_kwargs = dict(L2NORM_QK=True, eps=L2NORM_EPS)
        _by_route(_kda_dv_local_kernel, (plan.NC * NV, H), args(BV), span_flags, whole=not only_flagged,
                  whole_launch=((plan.NC * cdiv(V, BVW), H), whole_args, whole_kwargs), worklist=worklist)
    return dvl


def _by_route(kernel, grid, args, span_flags, whole: bool = True, whole_launch=None, worklist=None):
    """One of the backward's block kernels (7, 9b, 10b) over every chunk by 16-row blocks (span_flags
    None), or twice on the recompute's flags (DIAGONAL_FORM "chunk"): the unflagged chunks whole
    (CHUNKS "whole", on WHOLE_CHUNK_WARPS; whole_launch: its own (grid, args[, kwargs]), else grid and args;
    not when `whole` is False: 9 or 10 took them, see BACKWARD_FUSED_PAIRS), then the flagged ones
    by blocks: on grid, each program returning at an unflagged chunk, or, given their worklist, on
    a persistent grid over it (CHUNKS "worklist")."""
    if span_flags is None:
        kernel[grid](*args, **_LAUNCH_BACKWARD)
        return
    if whole:
        whole_grid, whole_args, *whole_kwargs = whole_launch or (grid, args)
        kernel[whole_grid](*whole_args, CHUNKS="whole", flags_ptr=span_flags, **dict(*whole_kwargs),
                           **dict(_LAUNCH_BACKWARD, num_warps=WHOLE_CHUNK_WARPS))
    _flagged_launch(kernel, grid, args, span_flags, worklist, _LAUNCH_BACKWARD)


def _flagged_launch(kernel, grid, args, span_flags, worklist, launch, **kwargs):
    """The flagged chunks' launch of a backward kernel whose grid is (NC * items a chunk, H): that
    grid, its programs returning at unflagged chunks (CHUNKS "flagged"), or with their worklist
    (`flagged_worklist`) a persistent grid over it (CHUNKS "worklist"; grid (P,) at
    WORKLIST_PROGRAMS_PER_SM: no program per unflagged chunk, which cost the forward's flagged
    launches 13-26 us each at S1 with none flagged)."""
    if worklist is None:
        kernel[grid](*args, CHUNKS="flagged", flags_ptr=span_flags, **kwargs, **launch)
    else:
        programs = worklist_programs(span_flags.device, grid[0] * grid[1])
        kernel[(programs,)](*args, CHUNKS="worklist", flags_ptr=span_flags, work_ptr=worklist, **kwargs, **launch)


# Whether the backward's flagged chunks' launches (7, 9, 9b, 10, 10b) run on a persistent grid over
# their worklist (`flagged_worklist`, formed once per backward) instead of a grid of every chunk
# whose programs return at unflagged ones (the forward's flagged routes do since the twenty-third
# session: 13.6 + 25.7 -> 1.5 + 1.6 us). On the H200 (kda_ab "flagged-worklist", twenty-fifth
# session, S1, gluon backward from kept tiles and states): with the bench's gates (no chunk flagged)
# the five launches' ~103 us -> ~10 us with the worklist's, backward 6.147 -> 6.053 ms; with steep
# gates (every chunk flagged) 21.89 -> 22.19 ms (the worklist loop's spills in 7 and 9); gradients
# bitwise equal in both, and in tests/test_kda_flagged_worklist.py's ragged cases there. The gate's
# other files ran there with it off (the grid form, now tests/test_kda_forms.py's "bwd-flagged-grid").
# Read at each call.
BACKWARD_FLAGGED_WORKLIST = True

# Whether a backward from the forward's kept states (KEEP_FORWARD_STATES: no stage-5 recompute, the
# one other reader of U) never forms U: stage 10 takes dXu U^T as (dXu (diag(beta) V)^T) T^T
# (`_kda_wy_bwd_kernel` and the gluon backend's `_kda_wy_dA_kernel`, U_FREE; docs/perf/kda.md,
# "Plan: the backward without W and U", step 1; row 36). H200, twenty-sixth session (kda_ab
# "u-from-t" at 7f48ad3, S1, one process, same inputs): backward from kept states 6.027 -> 5.819 ms
# with the bench's gates (predicted -0.2), forward+backward through chunk_kda 7.110 -> 6.934; steep
# gates 22.17 -> 21.81; gradients within 2.0e-4 normwise of the U-forming backward's; the gate's
# fused-t-u-from-t cases and the route-by-route stage-10 test passed there, racecheck of the U_FREE
# dA kernel clean. The U-forming form stays in the gate (tests/test_kda_gluon_states.py "fused-t").
# Read at each call.
BACKWARD_U_FROM_T = True


def chunk_dqkwg_kda(q, k, G, h, dh, vn, dvn, do, scale: float, plan, input_dtype: torch.dtype, span_flags=None,
                    fuse_9b: bool = False, outputs=None, worklist=None):
    """9: fp32 partials dQ', dK', dW, dG' [Ntok, H, K] and dP [Ntok, H, 64]. fuse_9b (needs
    span_flags): 9b's whole-chunk pair terms fused here (BACKWARD_FUSED_PAIRS): the chunks the flags
    leave unflagged come out with them added, and 9b launches only the flagged ones. outputs: the
    five buffers (dq, dk, dw, dG, dp with its slices), whose unflagged chunks another kernel has
    already written (fuse_9b's contract): only the flagged chunks are launched here, into them (on
    a persistent grid over their worklist where given)."""
    if (fuse_9b or outputs is not None) and span_flags is None:
        raise ValueError("chunk_dqkwg_kda: fuse_9b needs span_flags (the recompute's per-chunk flags)")
    if outputs is not None and not fuse_9b:
        raise ValueError("chunk_dqkwg_kda: outputs (another kernel took the unflagged chunks) needs fuse_9b")
    Ntok, H, K = q.shape
    V = do.shape[-1]
    BK, BV, NV = _blocks(K, V)
    BKS, NK = _key_split(K)
    if outputs is None:
        dq, dk, dw, dG = (new_empty((Ntok, H, K), _F32, q.device) for _ in range(4))
        # fused: one dP slice per block of key columns, each written by its own programs
        dp = new_empty((NK if fuse_9b else 1, Ntok, H, BT), _F32, q.device)
    else:
        dq, dk, dw, dG, dp = outputs
    if plan.NC:
        DT, DA, PREC = _products(input_dtype, True)
        args = (q, k, G, h, dh, vn, dvn, do, dq, dk, dw, dG, dp, plan.chunks, H, scale, K, V, BKS, BV, NV, BT, PREC,
                DT, DA)
        if outputs is not None:  # the flagged chunks only
            _flagged_launch(_kda_dqkwg_kernel, (plan.NC * NK, H), args, span_flags, worklist, _LAUNCH_CHUNK,
                            PAIRS=True, dp_stride=Ntok * H * BT)
        else:
            pair_args = dict(PAIRS=True, flags_ptr=span_flags, dp_stride=Ntok * H * BT) if fuse_9b else {}
            _kda_dqkwg_kernel[(plan.NC * NK, H)](*args, **pair_args, **_LAUNCH_CHUNK)
    return dq, dk, dw, dG, dp[0]


def chunk_dp_apply_kda(dp, q, k, G, dq, dk, dG, plan, input_dtype: torch.dtype, span_flags=None,
                       whole: bool = True, worklist=None):
    """9b: adds the pair terms of dP into dq, dk, dG (9's partials), in place; span_flags and
    worklist as 7's; whole False: the flagged chunks only (9 took the others: `chunk_dqkwg_kda`'s pairs)."""
    Ntok, H, K = q.shape
    if plan.NC:
        DT, DA, PREC = _products(input_dtype, True)
        _by_route(_kda_dp_apply_kernel, (plan.NC, H), (dp, q, k, G, dq, dk, dG, plan.chunks, H, K, _blocks(K, 1)[0], BT,
                                                       PREC, DT, DA, _factored_diagonal()), span_flags, whole=whole,
                  worklist=worklist)


def chunk_wy_bwd_kda(k, v, beta, G, Ai, w, u, dw, dvn, dk, dG, plan, dv_dtype: torch.dtype,
                     input_dtype: torch.dtype, span_flags=None, outputs_10b=None, only_flagged: bool = False,
                     dv=None, worklist=None):
    """10a: (dA [Ntok, H, 64] fp32, dbeta' [Ntok, H] fp32, dv [Ntok, H, V] in dv_dtype); adds into dk, dG.
    outputs_10b: 10b's outputs (dk, dbeta, dg; `_da_apply_outputs`) where 10b's whole-chunk route is
    fused here (needs span_flags): the chunks the flags leave unflagged get their final values in
    them here; for those chunks dA is still written (this kernel reads it back), dbeta' is not
    written at all, and 9's partials dk, dG are read but left as they were. only_flagged (with
    outputs_10b): another kernel has finished the unflagged chunks (their dk, dbeta, dg, and dv in
    `dv`, which this launch completes): only the flagged chunks are launched here (on a persistent
    grid over their worklist where given). u None: U was never formed (BACKWARD_U_FROM_T), the
    kernel's U_FREE form."""
    if outputs_10b is not None and span_flags is None:
        raise ValueError("chunk_wy_bwd_kda: outputs_10b needs span_flags (the recompute's per-chunk flags)")
    if only_flagged and (outputs_10b is None or dv is None):
        raise ValueError("chunk_wy_bwd_kda: only_flagged needs outputs_10b and dv (the other kernel's outputs)")
    Ntok, H, K = k.shape
    V = v.shape[-1]
    BK, BV, NV = _blocks(K, V)
    da = new_empty((Ntok, H, BT), _F32, k.device)
    dbp = new_empty((Ntok, H), _F32, k.device)
    dv = _out((Ntok, H, V), dv_dtype, k.device) if dv is None else dv
    if plan.NC:
        DT, DA, PREC = _products(input_dtype, True)
        args = (k, v, beta, G, Ai, w, u, dw, dvn, dk, dG, da, dbp, dv, plan.chunks, H, K, V, BK, BV, NV, BT, PREC, DT,
                DA)
        if only_flagged:
            _flagged_launch(_kda_wy_bwd_kernel, (plan.NC, H), args, span_flags, worklist, _LAUNCH_CHUNK,
                            CB=min(BK, 64), PAIRS=True, dk_ptr=outputs_10b[0], dbeta_ptr=outputs_10b[1],
                            dg_ptr=outputs_10b[2], U_FREE=u is None)
        else:
            pair_args = {} if outputs_10b is None else dict(PAIRS=True, flags_ptr=span_flags, dk_ptr=outputs_10b[0],
                                                            dbeta_ptr=outputs_10b[1], dg_ptr=outputs_10b[2])
            _kda_wy_bwd_kernel[(plan.NC, H)](*args, CB=min(BK, 64), U_FREE=u is None, **pair_args, **_LAUNCH_CHUNK)
    return da, dbp, _done(dv, dv_dtype)


def _da_apply_outputs(k, dk_dtype: torch.dtype, dbeta_dtype: torch.dtype, dg_dtype: torch.dtype):
    """10b's output buffers (dk [Ntok, H, K], dbeta [Ntok, H], dg [Ntok, H, K]) in the dtypes asked for
    (`_out`: fp32 for bf16 under the interpreter; `_done` rounds them)."""
    Ntok, H, K = k.shape
    return (_out((Ntok, H, K), dk_dtype, k.device), _out((Ntok, H), dbeta_dtype, k.device),
            _out((Ntok, H, K), dg_dtype, k.device))


def chunk_da_apply_kda(da, k, beta, G, dkp, dGp, dbp, plan, dk_dtype: torch.dtype, dbeta_dtype: torch.dtype,
                       dg_dtype: torch.dtype, input_dtype: torch.dtype, span_flags=None, outputs_10b=None,
                       worklist=None):
    """10b: the final dk [Ntok, H, K], dbeta [Ntok, H] and dg [Ntok, H, K], each in the dtype asked
    for; span_flags and worklist as 7's. outputs_10b: the buffers 10 has already finished the unflagged chunks of
    (`chunk_wy_bwd_kda`'s): only the flagged chunks are launched here, into them."""
    Ntok, H, K = k.shape
    dk, dbeta, dg = (outputs_10b if outputs_10b is not None else
                     _da_apply_outputs(k, dk_dtype, dbeta_dtype, dg_dtype))
    if plan.NC:
        DT, DA, PREC = _products(input_dtype, True)
        _by_route(_kda_da_apply_kernel, (plan.NC, H), (da, k, beta, G, dkp, dGp, dbp, dk, dbeta, dg, plan.chunks, H, K,
                                                       _blocks(K, 1)[0], BT, PREC, DT, DA, _factored_diagonal()),
                  span_flags, whole=outputs_10b is None, worklist=worklist)
    return _done(dk, dk_dtype), _done(dbeta, dbeta_dtype), _done(dg, dg_dtype)


# The dtype of the backward's l2-normalised q and k for 16-bit inputs: "fp32" (each stage reads
# 268 MB a tensor at S1, six stages) or "input" (bf16, as the forward's stage 3 stores the keys:
# half the bytes, and the products' operands rounded as the forward's are). An experiment for the
# backward's byte budget (docs/perf/kda.md, "The backward's bytes"): the gate's bounds under the
# interpreter decide first. In the gluon backend each Gluon stage's rule picks its kernel by these
# operands' dtypes (stage 9's takes bf16 q and k; stage 8's Gluon recurrence too with GDN's
# DSTATES_16BIT_KEYS on). "input" since the H200 timed it with that recurrence (kda_ab
# "normalised-qk" at a876bf4, S1): the backward from kept tiles 5.059 -> 4.874 ms, the gradients
# 3.2e-3 (normwise) from the fp32 form's, as the forward's bf16 keys round them (FLA keeps its
# normalised q and k in the inputs' dtype too).
BACKWARD_NORMALISED_QK = "input"


def kda_backward_triton(do, dht, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                        states=None, dstates=None, kept=None, dqkwg=None, wy_bwd=None, dv_local=None):
    """(dq, dk, dv, dg, dbeta, d initial_state or None), each in its input's dtype: recomputes the
    forward's stages 1-5 (T stored, fp32 intermediates; less where `kept` says), then 7, 8 (GDN's,
    per-channel), 9, 9b, 10, 10b.
    states, dstates: the recompute's stage 5 and stage 8 (another backend's, e.g. the gluon
    backend's on GDN's Gluon recurrence kernel; `chunk_states`' and `chunk_dstates`' contracts; None:
    those two). dqkwg, wy_bwd, dv_local: stages 9, 10 and 7 likewise (`chunk_dqkwg_kda`'s,
    `chunk_wy_bwd_kda`'s and `chunk_dv_local_kda`'s contracts, with the flagged chunks' worklist or
    None: BACKWARD_FLAGGED_WORKLIST). kept: the forward's `KeptTiles` (KEEP_FORWARD_TILES): G, T and the flags are its,
    and W and U are formed from T (`chunk_wu_from_t_kda`) instead of recomputing stage 3; where it
    holds h and Vn (KEEP_FORWARD_STATES), stage 5 is not recomputed either."""
    states = states or chunk_states
    dstates = dstates or chunk_dstates
    dqkwg = dqkwg or chunk_dqkwg_kda
    wy_bwd = wy_bwd or chunk_wy_bwd_kda
    dv_local = dv_local or chunk_dv_local_kda
    B, T, H, K = q.shape
    plan = make_plan(B, T, cu_seqlens, q.device)
    qf, kf, vf, gf, bf = (_flatten(x) for x in (q, k, v, g, beta))
    dof = _flatten(do.to(q.dtype))
    h0 = initial_state.contiguous() if initial_state is not None else None
    dht = dht.contiguous() if dht is not None else None
    dt = q.dtype
    l2 = use_qk_l2norm_in_kernel
    if l2:
        normed = _F32 if _products(dt, True)[2] != "ieee" else dt
        if _checked("BACKWARD_NORMALISED_QK", BACKWARD_NORMALISED_QK, ("fp32", "input")) == "input":
            normed = dt
        qn = l2norm_fwd(qf, normed)
        # the forward's normalised keys where it kept them in this dtype (`l2norm_fwd`'s to the bit)
        kept_keys = kept.kn if kept is not None else None
        kn = kept_keys if kept_keys is not None and kept_keys.dtype == normed else l2norm_fwd(kf, normed)
    else:
        qn, kn = qf, kf
    # with BACKWARD_WHOLE_CHUNKS the recompute's stage 3 in whole-chunk tiles too, its flags routing 7, 9b, 10b
    if kept is not None and BACKWARD_WHOLE_CHUNKS:
        G, Ai, flags = kept[:3]
        # U's one reader besides stage 10 is stage 5's recompute, which kept states spare
        u_free = _checked("BACKWARD_U_FROM_T", BACKWARD_U_FROM_T, (False, True)) and kept.h is not None
        w16 = (_checked("BACKWARD_W_DTYPE", BACKWARD_W_DTYPE, ("fp32", "bf16")) == "bf16"
               and dt in (torch.bfloat16, torch.float16))
        w, u = chunk_wu_from_t_kda(Ai, kn, vf, bf, G, flags, plan, dt, keys_normalised=l2, with_u=not u_free,
                                   w_dtype=torch.bfloat16 if w16 else _F32)
    else:
        flags = _span_flags(plan, H, q, BACKWARD_WHOLE_CHUNKS)
        G, g_in_3 = _gate_sums(gf, plan, flags, dt)
        Ai, w, u = chunk_solve_wu(kn, vf, bf, G, plan, store_T=True, exact_wu=True, input_dtype=dt,
                                  factored_diagonal=_factored_diagonal(), keys_normalised=l2 and flags is not None,
                                  g=g_in_3, span_flags=flags)
    if kept is not None and BACKWARD_WHOLE_CHUNKS and kept.h is not None:
        h, vn = kept.h, kept.vn  # the forward's (KEEP_FORWARD_STATES)
    else:
        h, vn, _ = states(kn, w, u, G, h0, plan, False, input_dtype=dt, for_backward=True)
    fused_stages = _fused_pairs() if flags is not None else ()
    # the flagged chunks' launches on a persistent grid over their worklist (formed once here)
    work = flagged_worklist(flags) if flags is not None and BACKWARD_FLAGGED_WORKLIST else None
    # stage 7's whole chunks from the raw q and k where their fp32 normalisation is what it would read
    raw_qk = (qf, kf) if _checked("DV_LOCAL_RAW_QK", DV_LOCAL_RAW_QK, (False, True)) and l2 and qn.dtype == _F32 else None
    dvl = dv_local(qn, kn, G, dof, scale, plan, dt, span_flags=flags, worklist=work, raw_qk=raw_qk)
    dstates16 = (_checked("BACKWARD_DSTATES_DTYPE", BACKWARD_DSTATES_DTYPE, ("fp32", "bf16")) == "bf16"
                 and dt in (torch.bfloat16, torch.float16))
    dh, dvn, dh0 = dstates(qn, kn, w, G, dof, dvl, dht, scale, plan, h0 is not None, input_dtype=dt,
                           states_dtype=torch.bfloat16 if dstates16 else _F32)
    dq, dkp, dw, dGp, dp = dqkwg(qn, kn, G, h, dh, vn, dvn, dof, scale, plan, dt, span_flags=flags,
                                 fuse_9b="9b" in fused_stages, worklist=work)
    chunk_dp_apply_kda(dp, qn, kn, G, dq, dkp, dGp, plan, dt, span_flags=flags, whole="9b" not in fused_stages,
                       worklist=work)
    outputs_10b = (_da_apply_outputs(kn, _F32 if l2 else k.dtype, beta.dtype, g.dtype) if "10b" in fused_stages
                   else None)
    da, dbp, dv = wy_bwd(kn, vf, bf, G, Ai, w, u, dw, dvn, dkp, dGp, plan, v.dtype, dt, span_flags=flags,
                         outputs_10b=outputs_10b, worklist=work)
    dk, dbeta, dg = chunk_da_apply_kda(da, kn, bf, G, dkp, dGp, dbp, plan, _F32 if l2 else k.dtype, beta.dtype,
                                       g.dtype, dt, span_flags=flags, outputs_10b=outputs_10b, worklist=work)
    if l2:
        dq = l2norm_bwd(qf, dq, q.dtype)
        dk = l2norm_bwd(kf, dk, k.dtype)
    else:
        dq = dq.to(q.dtype)
    if dh0 is not None and dh0.dtype != initial_state.dtype:
        dh0 = dh0.to(initial_state.dtype)
    return (dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), dg.view(g.shape), dbeta.view(beta.shape), dh0)
