"""Kimi Delta Attention float64 references: the frozen contract every backend is checked against.

KDA is Gated DeltaNet with a decay per key channel: g is [B, T, H, K]. Per sequence and head,
with state S (K x V) starting from `initial_state` (or zeros), for t = 1..T:

    S   = diag(exp(g_t)) S
    u_t = beta_t * (v_t - S^T k_t)
    S   = S + k_t u_t^T
    o_t = S^T (scale * q_t)

`kda_reference` is that recurrence, one line per equation, differentiable through autograd: the
contract for outputs and gradients. `chunked_reference` is the chunked WY / UT-transform form over
chunks of 64 that the Triton kernels implement, with the same gate-exponent scheme (see its
docstring); the tests check it against the recurrence. `recurrent_backward` is the reference
backend's closed-form gradient (a reverse sweep, float64); the tests check it against autograd.

Kernel work never edits this file.
"""

from __future__ import annotations

import torch

from tileport.ops.gdn.reference import L2NORM_EPS, _l2norm_backward, _sequences, l2norm

CHUNK = 64
SUB = 16  # rows of a sub-block: the unit of the gate-exponent reference points (see chunked_reference)

f64 = torch.float64

__all__ = ["kda_reference", "chunked_reference", "recurrent_backward", "gated_products", "CHUNK", "SUB", "L2NORM_EPS"]


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel):
    K = q.shape[-1]
    if scale is None:
        scale = K ** -0.5
    q, k, v, g, beta = (x.to(f64) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    h0 = None if initial_state is None else initial_state.to(f64)
    return q, k, v, g, beta, float(scale), h0


def kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (o [B, T, H, V] float64, final state [N, H, K, V] float64 or None).

    Differentiable in q, k, v, g, beta and initial_state."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta, scale, h0 = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel)
    outs, finals = [], []
    for n, (b, bos, eos) in enumerate(_sequences(T, B, cu_seqlens)):
        S = h0[n] if h0 is not None else torch.zeros(H, K, V, dtype=f64, device=q.device)  # [H, K, V]
        for t in range(bos, eos):
            S = torch.exp(g[b, t])[:, :, None] * S
            u = beta[b, t][:, None] * (v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t]))
            S = S + k[b, t][:, :, None] * u[:, None, :]
            outs.append((b, t, torch.einsum("hkv,hk->hv", S, scale * q[b, t])))
        finals.append(S)
    o = torch.zeros(B, T, H, V, dtype=f64, device=q.device)
    if outs:
        idx_b = torch.tensor([x[0] for x in outs], device=q.device)
        idx_t = torch.tensor([x[1] for x in outs], device=q.device)
        o = o.index_put((idx_b, idx_t), torch.stack([x[2] for x in outs]))
    final = torch.stack(finals) if output_final_state else None
    return o, final


def gated_products(X: torch.Tensor, Kc: torch.Tensor, G: torch.Tensor, inclusive: bool) -> torch.Tensor:
    """M_ts = sum_c X_tc Kc_sc exp(G_tc - G_sc) for s < t (s <= t if inclusive), else 0. [H, L, L].

    X, Kc, G: [H, L, K]; G is the in-chunk cumulative gate (non-increasing in t when g <= 0).
    Computed as the kernels do, in sub-blocks of SUB rows, so that no factor can overflow:
    - rows t of sub-block i against columns s of earlier sub-blocks (s < r = SUB * i <= t) use
      the reference point r: (X_t exp(G_t - G_r)) . (Kc_s exp(G_r - G_s)); with g <= 0 both
      exponents are <= 0, so each factor is at most |X_t| resp. |Kc_s| and the worst that can happen
      is an underflow to 0 of a term whose exact value is below fp32's smallest normal.
    - the diagonal sub-block (t, s in the same SUB rows) uses the exact pairwise differences
      G_t - G_s (t >= s, so again <= 0), as a [SUB, SUB, K] product.
    That holds for any gate values (-20, -1000, ...), with no clamping."""
    H, L, K = X.shape
    out = torch.zeros(H, L, L, dtype=X.dtype, device=X.device)
    for i0 in range(0, L, SUB):
        i1 = min(i0 + SUB, L)
        if i0 > 0:
            Gr = G[:, i0:i0 + 1, :]  # [H, 1, K]
            xq = X[:, i0:i1] * torch.exp(G[:, i0:i1] - Gr)
            kk = Kc[:, :i0] * torch.exp(Gr - G[:, :i0])
            out[:, i0:i1, :i0] = xq @ kk.transpose(1, 2)
        Gi = G[:, i0:i1]
        n = i1 - i0
        keep = torch.ones(n, n, dtype=torch.bool, device=X.device).tril(0 if inclusive else -1)
        diff = torch.where(keep[None, :, :, None], Gi[:, :, None, :] - Gi[:, None, :, :], -torch.inf)
        out[:, i0:i1, i0:i1] = (X[:, i0:i1, None, :] * Kc[:, None, i0:i1, :] * diff.exp()).sum(-1)
    return out


def chunked_reference(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size: int = CHUNK,
):
    """The chunked WY / UT-transform form (float64), as the Triton kernels compute it.

    Per sequence and head, chunk c holds positions t = 0..L-1 (L <= chunk_size). G_t in R^K is the
    per-channel cumulative sum of g inside the chunk (G_L: its value at the last valid position),
    h_c the state entering the chunk, and products are taken channel-wise (`gated_products`):

        A     = strict_lower(diag(beta) [sum_c k_tc k_sc exp(G_tc - G_sc)])
        T     = (I + A)^-1
        W     = T diag(beta) (exp(G) * K)                     [L, K]
        U     = T diag(beta) V                                [L, V]
        Vn    = U - W h_c
        O     = scale ((exp(G) * Q) h_c + lower[sum_c q_tc k_sc exp(G_tc - G_sc)] Vn)
        h_c+1 = diag(exp(G_L)) h_c + (exp(G_L - G) * K)^T Vn

    Derivation as for GDN (gdn.reference.chunked_reference) with diag(exp(G_t)) in place of the
    scalar: S_t = diag(exp(G_t)) h_c + sum_{s<=t} diag(exp(G_t - G_s)) k_s u_s^T.
    Every exponent is a difference G_t - G_s with t >= s, G_t - G_r with t >= r, G_r - G_s with
    r > s, or G_t itself (all <= 0 for g <= 0): nothing overflows for any gate magnitude.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta, scale, h0 = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel)
    o = torch.zeros(B, T, H, V, dtype=f64, device=q.device)
    finals = []
    for n, (b, bos, eos) in enumerate(_sequences(T, B, cu_seqlens)):
        h = h0[n].clone() if h0 is not None else torch.zeros(H, K, V, dtype=f64, device=q.device)
        for c0 in range(bos, eos, chunk_size):
            c1 = min(c0 + chunk_size, eos)
            L = c1 - c0
            qc, kc, vc = (x[b, c0:c1].transpose(0, 1) for x in (q, k, v))  # [H, L, D]
            bc = beta[b, c0:c1].transpose(0, 1)  # [H, L]
            G = g[b, c0:c1].transpose(0, 1).cumsum(1)  # [H, L, K]
            A = bc[:, :, None] * gated_products(kc, kc, G, inclusive=False)
            eye = torch.eye(L, dtype=f64, device=q.device)
            Tm = torch.linalg.solve_triangular(eye + A, eye.expand(H, L, L), upper=False, unitriangular=True)
            W = Tm @ (bc[:, :, None] * G.exp() * kc)
            U = Tm @ (bc[:, :, None] * vc)
            Vn = U - W @ h
            P = gated_products(qc, kc, G, inclusive=True)
            oc = scale * ((G.exp() * qc) @ h + P @ Vn)
            o[b, c0:c1] = oc.transpose(0, 1)
            GL = G[:, -1]  # [H, K]
            h = GL.exp()[:, :, None] * h + ((GL[:, None, :] - G).exp() * kc).transpose(1, 2) @ Vn
        finals.append(h)
    return o, (torch.stack(finals) if output_final_state else None)


def recurrent_backward(
    grad_o, grad_final, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
):
    """Closed-form gradients of `kda_reference` by a reverse sweep (float64, no autograd).

    Returns (dq, dk, dv, dg, dbeta, dh0) in float64 (dh0 None without an initial state); dg is
    [B, T, H, K]. Per step t, going backwards with dS the gradient of the state after step t:
        dS  += scale q_t do_t^T;       dq_t = scale S_t do_t
        dk_t = dS u_t;                 du_t = dS^T k_t
        dv_t = beta_t du_t;            dbeta_t = du_t . (v_t - r_t),   r_t = S'^T k_t, S' = diag(exp(g_t)) S_{t-1}
        dr_t = -beta_t du_t;           dk_t += S' dr_t;   dS' = dS + k_t dr_t^T
        dg_t = rowsum(S' * dS') (one value per key channel);   dS_{t-1} = diag(exp(g_t)) dS'
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    q_raw, k_raw = q.to(f64), k.to(f64)
    q, k, v, g, beta, scale, h0 = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel)
    do = grad_o.to(f64)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dg, dbeta = torch.zeros_like(g), torch.zeros_like(beta)
    seqs = _sequences(T, B, cu_seqlens)
    dh0 = torch.zeros(len(seqs), H, K, V, dtype=f64, device=q.device) if h0 is not None else None
    for n, (b, bos, eos) in enumerate(seqs):
        S = h0[n].clone() if h0 is not None else torch.zeros(H, K, V, dtype=f64, device=q.device)
        states, primes, us, rs = [S], [], [], []
        for t in range(bos, eos):
            Sp = torch.exp(g[b, t])[:, :, None] * S
            r = torch.einsum("hkv,hk->hv", Sp, k[b, t])
            u = beta[b, t][:, None] * (v[b, t] - r)
            S = Sp + k[b, t][:, :, None] * u[:, None, :]
            states.append(S)
            primes.append(Sp)
            us.append(u)
            rs.append(r)
        dS = grad_final[n].to(f64).clone() if grad_final is not None else torch.zeros(H, K, V, dtype=f64, device=q.device)
        for i in range(eos - bos - 1, -1, -1):
            t = bos + i
            qt, kt, dot = q[b, t], k[b, t], do[b, t]
            dS = dS + scale * qt[:, :, None] * dot[:, None, :]
            dq[b, t] = scale * torch.einsum("hkv,hv->hk", states[i + 1], dot)
            du = torch.einsum("hkv,hk->hv", dS, kt)
            dk_t = torch.einsum("hkv,hv->hk", dS, us[i])
            dv[b, t] = beta[b, t][:, None] * du
            dbeta[b, t] = (du * (v[b, t] - rs[i])).sum(-1)
            dr = -beta[b, t][:, None] * du
            dk_t = dk_t + torch.einsum("hkv,hv->hk", primes[i], dr)
            dk[b, t] = dk_t
            dSp = dS + kt[:, :, None] * dr[:, None, :]
            dg[b, t] = (primes[i] * dSp).sum(-1)
            dS = torch.exp(g[b, t])[:, :, None] * dSp
        if dh0 is not None:
            dh0[n] = dS
    if use_qk_l2norm_in_kernel:
        dq = _l2norm_backward(q_raw, dq)
        dk = _l2norm_backward(k_raw, dk)
    return dq, dk, dv, dg, dbeta, dh0
