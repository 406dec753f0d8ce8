"""Kimi Delta Attention, Triton backend (forward): GDN's chunked algorithm with per-channel gates.

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
G stays fp64 and every exponent is an fp64 difference rounded to fp32 (see GDN's docstring).

Backward: not in Triton yet. The "triton" backend's backward runs the float64 reference reverse
sweep (kda.reference.recurrent_backward); see tileport.ops.kda.

Interpreter workarounds (bf16 dots and stores) are GDN's: `_op`, `_out`, `_done`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileport.ops.gdn.triton_kernels import (
    BT,
    _blocks,
    _done,
    _dot_types,
    _flatten,
    _op,
    _out,
    chunk_cumsum,
    chunk_solve_wu,
    chunk_states,
    l2norm_fwd,
    make_plan,
    triton_refusal,
)

__all__ = ["kda_forward_triton", "chunk_output_kda", "triton_refusal"]

_LAUNCH_OUTPUT = dict(num_warps=4)
# How stage 3 (GDN's solve kernel, PER_CHANNEL) and the output kernel form each 16-row
# sub-block's diagonal block: "exact" (pairwise exponents, always) or "factored" (reference-row
# factors when the sub-block's gates span at most SPAN_MAX, the exact form otherwise). Off until
# the H200 has run the gate and timed it (scripts/kda_ab.py).
DIAGONAL_FORM = "exact"


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.jit
def _kda_output_kernel(q_ptr, k_ptr, G_ptr, h_ptr, vn_ptr, o_ptr, chunks_ptr, H, scale,
                       K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                       BT: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr,
                       FACTORED_DIAGONAL: tl.constexpr = False, SPAN_MAX: tl.constexpr = 40.0):
    """6: O = scale ((exp(G) * Q) h_c + lower[sum_c q_tc k_sc exp(G_tc - G_sc)] Vn), in o's dtype,
    one 16-row sub-block of the chunk at a time (see the module docstring for the exponents);
    grid (NC * V/BV, H).

    FACTORED_DIAGONAL: a sub-block whose gates span at most SPAN_MAX (max |G_s - G_r| over its
    rows and channels, checked at run time) forms its diagonal block like the earlier ones, from
    the reference-row factors, so the whole row block is one tensor-core dot; steeper sub-blocks
    keep the exact pairwise [16, 16, K] form. Why: that form's reduction over key channels is a
    shuffle tree across lanes (5120 shfl per thread, sm_90a PTX) and set the kernel's issue floor
    at 1.47 ms at S1 (docs/perf/kda.md); exp(SPAN_MAX) = 2.4e17 keeps every factor finite in bf16."""
    c = tl.program_id(0) // NV
    j = tl.program_id(0) % NV
    hh = tl.program_id(1)
    bos = tl.load(chunks_ptr + 2 * c)
    eos = tl.load(chunks_ptr + 2 * c + 1)
    NB: tl.constexpr = BT // 16
    CB: tl.constexpr = 32 if BK > 32 else BK
    r = tl.arange(0, BT)
    r16 = tl.arange(0, 16)
    kc = tl.arange(0, BK)
    vc = j * BV + tl.arange(0, BV)
    tok = bos + r
    valid = tok < eos
    row = tok.to(tl.int64) * H + hh
    mv = valid[:, None] & (vc < V)[None, :]
    vn = _op(tl.load(vn_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0), DT, DA)
    h = _op(tl.load(h_ptr + (c.to(tl.int64) * H + hh) * (K * V) + kc[:, None] * V + vc[None, :],
                    mask=(kc < K)[:, None] & (vc < V)[None, :], other=0.0), DT, DA)
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


def chunk_output_kda(q, k, G, h, vn, scale: float, plan, out_dtype: torch.dtype):
    """6: o [Ntok, H, V] in out_dtype; G [Ntok, H, K] fp64."""
    Ntok, H, K = q.shape
    V = vn.shape[-1]
    BK, BV, NV = _blocks(K, V)
    o = _out((Ntok, H, V), out_dtype, q.device)
    if plan.NC:
        _kda_output_kernel[(plan.NC * NV, H)](q, k, G, h, vn, o, plan.chunks, H, scale, K, V, BK, BV, NV, BT,
                                             *_dot_types(q.dtype), DIAGONAL_FORM == "factored",
                                             **_LAUNCH_OUTPUT)
    return _done(o, out_dtype)


def kda_forward_triton(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    """(o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32 or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    plan = make_plan(B, T, cu_seqlens, q.device)
    qf, kf, vf, gf, bf = (_flatten(x) for x in (q, k, v, g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm_fwd(qf), l2norm_fwd(kf)
    G = chunk_cumsum(gf, plan)  # [Ntok, H, K] fp64
    _, w, u = chunk_solve_wu(kf, vf, bf, G, plan, compact=True, factored_diagonal=DIAGONAL_FORM == "factored")
    h, vn, ht = chunk_states(kf, w, u, G, h0, plan, output_final_state)
    o = chunk_output_kda(qf, kf, G, h, vn, scale, plan, q.dtype)
    return o.view(B, T, H, V), ht
