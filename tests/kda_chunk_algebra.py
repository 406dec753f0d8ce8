"""The KDA backward over chunks of 64, in float64 PyTorch: the algebra the Triton backward
implements, stage by stage (docs/perf/kda.md, "The Triton backward"). Not a backend; the test
beside it checks it against the reference's reverse sweep, so a kernel stage can be compared with
the matching line here.

Per chunk (rows t = 0..L-1, G the in-chunk cumulative gate per channel, G_L its last row), with
the gated products in both directions (M lower-triangular [L, L], X, Y [L, K]):

    R(M, X)_tc = sum_s M_ts X_sc exp(G_tc - G_sc)        C(M, Y)_sc = sum_t M_ts Y_tc exp(G_tc - G_sc)
"""

from __future__ import annotations

import torch

from tileport.ops.gdn.reference import _l2norm_backward, _sequences
from tileport.ops.kda.reference import _prepare, gated_products

f64 = torch.float64


def gated_rows(M, X, G):
    """R(M, X): [H, L, L] x [H, L, K] -> [H, L, K] (pairwise exponents; float64 holds them)."""
    E = torch.exp(torch.where(torch.ones_like(M, dtype=torch.bool).tril()[..., None],
                              G[:, :, None, :] - G[:, None, :, :], -torch.inf))  # [H, t, s, K]
    return (M[..., None] * X[:, None, :, :] * E).sum(2)


def gated_cols(M, Y, G):
    """C(M, Y): sum over t of M_ts Y_tc exp(G_tc - G_sc) -> [H, L(s), K]."""
    E = torch.exp(torch.where(torch.ones_like(M, dtype=torch.bool).tril()[..., None],
                              G[:, :, None, :] - G[:, None, :, :], -torch.inf))
    return (M[..., None] * Y[:, :, None, :] * E).sum(1)


def chunked_backward(do, dht, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                     chunk: int = 64, wu_free: bool = False):
    """(dq, dk, dv, dg, dbeta, dh0) in float64, chunk by chunk. wu_free: the backward's loop never
    reads W = T Bk and U = T Bv (Bk = diag(beta) (exp(G) * K), Bv = diag(beta) V), only T and the
    inputs they are formed from (docs/perf/kda.md, "Plan: the backward without W and U"):
    W^T dVn = Bk^T (T^T dVn) in stage 8 and dXw W^T + dXu U^T = (dXw Bk^T + dXu Bv^T) T^T in
    stage 10; the forward's Vn and states are the recompute's as before."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q_raw, k_raw = q.to(f64), k.to(f64)
    q, k, v, g, beta, scale, h0 = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel)
    do = do.to(f64)
    dq, dk, dv, dg, dbeta = (torch.zeros_like(x) for x in (q, k, v, g, beta))
    seqs = _sequences(T, B, cu_seqlens)
    dh0 = torch.zeros(len(seqs), H, K, V, dtype=f64) if h0 is not None else None
    for n, (b, bos, eos) in enumerate(seqs):
        # forward recompute: per chunk the state entering it and the chunk's quantities
        h = h0[n].clone() if h0 is not None else torch.zeros(H, K, V, dtype=f64)
        saved = []
        for c0 in range(bos, eos, chunk):
            c1 = min(c0 + chunk, eos)
            L = c1 - c0
            Q, Kc, Vc = (x[b, c0:c1].transpose(0, 1) for x in (q, k, v))
            bc = beta[b, c0:c1].transpose(0, 1)
            G = g[b, c0:c1].transpose(0, 1).cumsum(1)
            A = bc[:, :, None] * gated_products(Kc, Kc, G, inclusive=False)
            eye = torch.eye(L, dtype=f64)
            Tm = torch.linalg.solve_triangular(eye + A, eye.expand(H, L, L), upper=False, unitriangular=True)
            W = Tm @ (bc[:, :, None] * G.exp() * Kc)
            U = Tm @ (bc[:, :, None] * Vc)
            Vn = U - W @ h
            saved.append((c0, c1, Q, Kc, Vc, bc, G, Tm, W, U, Vn, h))
            GL = G[:, -1]
            h = GL.exp()[:, :, None] * h + ((GL[:, None, :] - G).exp() * Kc).transpose(1, 2) @ Vn
        dh = dht[n].to(f64).clone() if dht is not None else torch.zeros(H, K, V, dtype=f64)
        for c0, c1, Q, Kc, Vc, bc, G, Tm, W, U, Vn, hc in reversed(saved):
            L = c1 - c0
            dO = do[b, c0:c1].transpose(0, 1)
            GL = G[:, -1]
            Kd = (GL[:, None, :] - G).exp() * Kc
            P = gated_products(Q, Kc, G, inclusive=True)
            # 7, 8: dVn, the state gradient entering the chunk
            dVn = scale * P.transpose(1, 2) @ dO + Kd @ dh
            Bk = bc[:, :, None] * G.exp() * Kc
            Bv = bc[:, :, None] * Vc
            W_dVn = Bk.transpose(1, 2) @ (Tm.transpose(1, 2) @ dVn) if wu_free else W.transpose(1, 2) @ dVn
            dh_in = GL.exp()[:, :, None] * dh + scale * (G.exp() * Q).transpose(1, 2) @ dO - W_dVn
            # 9: through O and h'
            dqh = scale * dO @ hc.transpose(1, 2)
            dP = torch.tril(scale * dO @ Vn.transpose(1, 2))
            # the pair terms without the diagonal, which dQ and dK take by hand; in dG the diagonal's
            # terms (q_t k_t dP_tt with each sign) and the last row's own Kd * dKd term cancel exactly
            # and are left out, as the kernels do (rounding noise would swamp a tiny dg)
            dPs = torch.tril(dP, -1)
            d = torch.diagonal(dP, dim1=1, dim2=2)[:, :, None]
            dQPs = gated_rows(dPs, Kc, G)
            dKPs = gated_cols(dPs, Q, G)
            dKd = Vn @ dh.transpose(1, 2)
            dW = -dVn @ hc.transpose(1, 2)
            dQc = G.exp() * dqh + dQPs + d * Kc
            dKc = dKPs + d * Q + (GL[:, None, :] - G).exp() * dKd
            x = Kd * dKd
            x[:, -1] = 0
            dG = Q * (G.exp() * dqh + dQPs) - Kc * dKPs - x
            dG[:, -1] += GL.exp() * (hc * dh).sum(-1) + x.sum(1)
            # 10: through W, U, T and A
            dXw = Tm.transpose(1, 2) @ dW
            dXu = Tm.transpose(1, 2) @ dVn
            if wu_free:
                dA = -torch.tril((dXw @ Bk.transpose(1, 2) + dXu @ Bv.transpose(1, 2)) @ Tm.transpose(1, 2), -1)
            else:
                dA = -torch.tril(dXw @ W.transpose(1, 2) + dXu @ U.transpose(1, 2), -1)
            RdA = gated_rows(dA, Kc, G)
            CB = gated_cols(bc[:, :, None] * dA, Kc, G)
            dv[b, c0:c1] = (bc[:, :, None] * dXu).transpose(0, 1)
            dbeta[b, c0:c1] = ((Vc * dXu).sum(-1) + (G.exp() * Kc * dXw).sum(-1) + (Kc * RdA).sum(-1)).transpose(0, 1)
            dKc = dKc + bc[:, :, None] * (G.exp() * dXw + RdA) + CB
            dG = dG + bc[:, :, None] * Kc * (G.exp() * dXw + RdA) - Kc * CB
            dq[b, c0:c1] = dQc.transpose(0, 1)
            dk[b, c0:c1] = dKc.transpose(0, 1)
            dg[b, c0:c1] = dG.flip(1).cumsum(1).flip(1).transpose(0, 1)
            dh = dh_in
        if dh0 is not None:
            dh0[n] = dh
    if use_qk_l2norm_in_kernel:
        dq = _l2norm_backward(q_raw, dq)
        dk = _l2norm_backward(k_raw, dk)
    return dq, dk, dv, dg, dbeta, dh0
