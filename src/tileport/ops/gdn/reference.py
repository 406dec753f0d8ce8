"""Gated DeltaNet float64 references: the frozen contract every backend is checked against.

`gdn_reference` is SPEC.md's step-by-step recurrence, one line per equation, in float64 and
differentiable through autograd: it is the contract for outputs and for gradients. Per sequence
and head, with state S (K x V) starting from `initial_state` (or zeros), for t = 1..T:

    S   = exp(g_t) * S
    u_t = beta_t * (v_t - S^T k_t)
    S   = S + k_t u_t^T
    o_t = S^T (scale * q_t)

With `use_qk_l2norm_in_kernel`, q and k are first normalised over their last dim as
x * rsqrt(sum(x^2) + 1e-6) (FLA's l2norm, eps 1e-6 inside the root).

`chunked_reference` computes the same thing in the chunked WY / UT-transform form over chunks
of 64 that the kernels implement (see its docstring for the algebra); the tests check it against
the recurrence. `recurrent_backward` is the reference backend's closed-form gradient (a reverse
sweep of the recurrence, float64); the tests check it against autograd through `gdn_reference`.

Kernel work never edits this file.
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6
CHUNK = 64

f64 = torch.float64


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _sequences(T: int, B: int, cu_seqlens) -> list[tuple[int, int, int]]:
    """(batch row, bos, eos) of each independent sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel):
    K = q.shape[-1]
    if scale is None:
        scale = K ** -0.5
    q, k, v, g, beta = (x.to(f64) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    h0 = None if initial_state is None else initial_state.to(f64)
    return q, k, v, g, beta, float(scale), h0


def gdn_reference(
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
            S = torch.exp(g[b, t])[:, None, None] * S
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


def chunked_reference(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size: int = CHUNK,
):
    """The chunked WY / UT-transform form (float64), as the Triton kernels compute it.

    Per sequence and head, chunk c holds positions t = 0..L-1 (L <= chunk_size; the last chunk
    of a sequence may be short). G_t is the cumulative sum of g inside the chunk (G_{L-1} = G_L
    below), Gam_ts = exp(G_t - G_s) (t >= s), h_c the state entering the chunk. Then

        A     = strict_lower(diag(beta) (K K^T * Gam))      intra-chunk gated k k^T
        T     = (I + A)^-1                                    UT transform (unit lower triangular)
        W     = T diag(beta exp(G)) K                         [L, K]
        U     = T diag(beta) V                                [L, V]
        Vn    = U - W h_c                                     (the u_t of the recurrence, "v_new")
        O     = scale (diag(exp(G)) Q h_c + lower(Q K^T * Gam) Vn)
        h_c+1 = exp(G_L) h_c + (diag(exp(G_L - G)) K)^T Vn

    Derivation: unrolling the recurrence inside the chunk gives
    S_t = exp(G_t) h_c + sum_{s<=t} exp(G_t - G_s) k_s u_s^T, so
    u_t = beta_t (v_t - exp(G_t) h_c^T k_t - sum_{s<t} exp(G_t - G_s) (k_t . k_s) u_s),
    i.e. (I + A) U_all = diag(beta) V - diag(beta exp(G)) K h_c, whose solution is U - W h_c.
    Exponents are always formed as differences G_t - G_s with t >= s (never exp(G_t) exp(-G_s)),
    so a very negative gate underflows to 0 instead of overflowing.
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
            # head-major views of the chunk: [H, L, D]
            qc, kc, vc = (x[b, c0:c1].transpose(0, 1) for x in (q, k, v))
            bc = beta[b, c0:c1].transpose(0, 1)  # [H, L]
            G = g[b, c0:c1].transpose(0, 1).cumsum(-1)  # [H, L]
            diff = G[:, :, None] - G[:, None, :]
            lower_incl = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
            lower_strict = lower_incl.tril(-1)
            Gam = torch.where(lower_incl, diff, torch.full_like(diff, -torch.inf)).exp()
            A = torch.where(lower_strict, bc[:, :, None] * (kc @ kc.transpose(1, 2)) * Gam, 0.0)
            eye = torch.eye(L, dtype=f64, device=q.device)
            Tm = torch.linalg.solve_triangular(eye + A, eye.expand(H, L, L), upper=False, unitriangular=True)
            W = Tm @ ((bc * G.exp())[:, :, None] * kc)
            U = Tm @ (bc[:, :, None] * vc)
            Vn = U - W @ h
            P = torch.where(lower_incl, (qc @ kc.transpose(1, 2)) * Gam, 0.0)
            oc = scale * (G.exp()[:, :, None] * (qc @ h) + P @ Vn)
            o[b, c0:c1] = oc.transpose(0, 1)
            GL = G[:, -1]
            h = GL.exp()[:, None, None] * h + ((GL[:, None] - G).exp()[:, :, None] * kc).transpose(1, 2) @ Vn
        finals.append(h)
    return o, (torch.stack(finals) if output_final_state else None)


def recurrent_backward(
    grad_o, grad_final, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
):
    """Closed-form gradients of `gdn_reference` by a reverse sweep (float64, no autograd).

    Returns (dq, dk, dv, dg, dbeta, dh0) in float64 (dh0 None without an initial state).
    Per step t, going backwards with dS the gradient of the state after step t:
        dS  += scale q_t do_t^T;       dq_t = scale S_t do_t
        dk_t = dS u_t;                 du_t = dS^T k_t
        dv_t = beta_t du_t;            dbeta_t = du_t . (v_t - r_t),   r_t = S'^T k_t, S' = exp(g_t) S_{t-1}
        dr_t = -beta_t du_t;           dk_t += S' dr_t;   dS' = dS + k_t dr_t^T
        dg_t = sum(S' * dS');          dS_{t-1} = exp(g_t) dS'
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
            Sp = torch.exp(g[b, t])[:, None, None] * S
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
            dg[b, t] = (primes[i] * dSp).sum((-2, -1))
            dS = torch.exp(g[b, t])[:, None, None] * dSp
        if dh0 is not None:
            dh0[n] = dS
    if use_qk_l2norm_in_kernel:
        dq = _l2norm_backward(q_raw, dq)
        dk = _l2norm_backward(k_raw, dk)
    return dq, dk, dv, dg, dbeta, dh0


def _l2norm_backward(x: torch.Tensor, dy: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    rstd = torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
    y = x * rstd
    return rstd * (dy - y * (dy * y).sum(-1, keepdim=True))
