"""KDA's whole-chunk form (DIAGONAL_FORM "chunk") routes each chunk by its gates: stage 3 flags a
chunk whose gates span more than 60 about its middle row (max over its rows and key channels of
abs(G_t - G_m), G the in-chunk cumsum), and only those take the 16-row block kernels. The gate
tests check the values either way; this checks the routing itself, which they cannot see (a wrong
middle row sent every other chunk of a sequence to the slow path and still passed them: H200,
1bd52d9), and each route of the backward's stage 7 on its own against its definition (the gate
sees only the route the flags pick), and 9b's and 10b's whole routes fused into 9 and 10
(BACKWARD_FUSED_PAIRS) against the unfused launches. Tails and varlen chunks included."""

from __future__ import annotations

import pytest
import torch

from tileport.ops.gdn import triton_kernels as tk

SPAN_MAX = 60.0


def expected_flags(G: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
    """The flags by definition, in float64: one per chunk and head."""
    out = []
    for bos, eos in chunks.view(-1, 2).tolist():
        n = min(eos - bos, tk.BT)
        Gc = G[bos:bos + n].double()
        span = (Gc - Gc[(n - 1) // 2]).abs().amax(dim=(0, 2))  # [H]
        out.append((span > SPAN_MAX).to(torch.int8))
    return torch.stack(out)


@pytest.mark.parametrize("g_in_stage3", [False, True], ids=["G-from-stage2", "G-formed-in-stage3"])
@pytest.mark.parametrize("cu", [None, [0, 1, 70, 70, 200, 330]], ids=["dense", "varlen"])
def test_stage3_flags_the_chunks_whose_gates_span_too_far(cu, g_in_stage3, device, seed):
    T, H, K, V = 330, 2, 32, 32
    g = torch.nn.functional.logsigmoid(torch.randn(T, H, K))  # ~0.8 per step: ~26 over half a chunk
    g[100:140, 0] = -20.0 - 10.0 * torch.rand(40, K)  # head 0: steep in the chunks around them
    g[260:270, 1, :3] = -3.0  # head 1: three channels steeper, a span near the bound
    k = torch.nn.functional.normalize(torch.randn(T, H, K), dim=-1).to(torch.bfloat16)
    v = torch.randn(T, H, V, dtype=torch.bfloat16)
    beta = torch.sigmoid(torch.randn(T, H)).to(torch.bfloat16)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    plan = tk.make_plan(1, T, cu_t, torch.device(device))
    k, v, g, beta = (x.to(device) for x in (k, v, g, beta))
    G = tk.chunk_cumsum(g, plan)
    flags = torch.full((plan.NC, H), 7, dtype=torch.int8, device=device)
    G3 = torch.full_like(G, float("nan")) if g_in_stage3 else G  # stage 3 forms G from g (KDA's CUMSUM_FORM "stage-3")
    tk.chunk_solve_wu(k, v, beta, G3, plan, compact=True, factored_diagonal=True, keys_normalised=True,
                      g=g if g_in_stage3 else None, span_flags=flags)
    if g_in_stage3:  # every chunk's sums stored, flagged or not (the same fp64 sums up to their order)
        torch.testing.assert_close(G3, G, rtol=1e-12, atol=1e-9)
    want = expected_flags(G.cpu(), plan.chunks.cpu())
    assert want.any() and not want.all(), "the draw should have chunks of both kinds"
    assert torch.equal(flags.cpu(), want), f"flags {flags.cpu().tolist()} != {want.tolist()}"


def test_span_flags_are_checked():
    T, H, K = 70, 2, 16
    plan = tk.make_plan(1, T, None, torch.device("cpu"))
    k = torch.randn(T, H, K, dtype=torch.bfloat16)
    G = torch.zeros(T, H, K, dtype=torch.float64)
    beta = torch.rand(T, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="span_flags must be int8"):
        tk.chunk_solve_wu(k, k, beta, G, plan, compact=True, span_flags=torch.zeros(plan.NC, H, dtype=torch.int32))
    with pytest.raises(ValueError, match="span_flags: the per-channel tile form"):
        tk.chunk_solve_wu(k.float(), k.float(), beta.float(), G, plan, compact=True,
                          span_flags=torch.zeros(plan.NC, H, dtype=torch.int8))


def dv_local_reference(q, k, G, do, scale, chunks):
    """Stage 7 by definition in float64: dVl_s = scale sum_{t >= s in s's chunk} P_ts dO_t,
    P_ts = sum_c q_tc k_sc exp(G_tc - G_sc)."""
    q, k, G, do = (x.double() for x in (q, k, G, do))
    out = torch.zeros_like(do)
    for bos, eos in chunks.view(-1, 2).tolist():
        n = min(eos - bos, tk.BT)
        sl = slice(bos, bos + n)
        P = torch.einsum("thc,shc,tshc->hts", q[sl], k[sl], torch.exp(G[sl, None] - G[None, sl]))
        P = P * torch.tril(torch.ones(n, n, dtype=P.dtype))
        out[sl] = scale * torch.einsum("hts,thv->shv", P, do[sl])
    return out


@pytest.mark.parametrize("route", ["whole", "blocks"])
def test_stage7_each_route_matches_its_definition(route, device, seed):
    """Stage 7 with every chunk sent one way (flags all clear: whole chunks; all set: 16-row blocks)
    against its float64 definition, on gates mild enough for both routes."""
    from tileport.ops.kda import triton_kernels as kk

    T, H, K, V = 150, 2, 32, 48
    cu = torch.tensor([0, 100, 150], dtype=torch.int32, device=device)
    plan = tk.make_plan(1, T, cu, torch.device(device))
    q, k = (torch.nn.functional.normalize(torch.randn(T, H, K), dim=-1) for _ in range(2))
    do = torch.randn(T, H, V).to(torch.bfloat16).float()
    G = tk.chunk_cumsum(torch.nn.functional.logsigmoid(torch.randn(T, H, K)).to(device), plan)
    flags = torch.full((plan.NC, H), 0 if route == "whole" else 1, dtype=torch.int8, device=device)
    got = kk.chunk_dv_local_kda(q.to(device), k.to(device), G, do.to(device), 0.3, plan, torch.bfloat16,
                                span_flags=flags)
    want = dv_local_reference(q, k, G.cpu(), do, 0.3, plan.chunks.cpu())
    err = ((got.cpu().double() - want).norm() / want.norm()).item()
    # the products are tf32 (truncated to 10 mantissa bits on the CPU, 2^-10 = 9.8e-4 per operand;
    # two chained products): ~1.1e-3 seen by either route, so 4e-3 fails a wrong route, not rounding
    assert err < 4e-3, f"stage 7 by {route}: normwise error {err:.2e}"


def gated_pair_reference(M, X, Y, G, chunks):
    """R(M, X) and C(M, Y) over s < t within each chunk, float64, by definition: R_tc = sum_s M_ts
    X_sc exp(G_tc - G_sc), C_sc = sum_t M_ts Y_tc exp(G_tc - G_sc); M [Ntok, H, 64] (row t holds
    M_t by the column s's place in the chunk)."""
    M, X, Y, G = (x.double() for x in (M, X, Y, G))
    R, C = torch.zeros_like(X), torch.zeros_like(Y)
    for bos, eos in chunks.view(-1, 2).tolist():
        n = min(eos - bos, tk.BT)
        sl = slice(bos, bos + n)
        Mc = M[sl, :, :n].permute(1, 0, 2) * torch.tril(torch.ones(n, n, dtype=M.dtype), -1)  # [h, t, s]
        E = torch.exp(G[sl, None] - G[None, sl]).permute(2, 0, 1, 3)  # [h, t, s, c]
        R[sl] = torch.einsum("hts,shc,htsc->thc", Mc, X[sl], E)
        C[sl] = torch.einsum("hts,thc,htsc->shc", Mc, Y[sl], E)
    return R, C


def _pair_inputs(device, K: int = 32):
    T, H = 150, 2
    cu = torch.tensor([0, 100, 150], dtype=torch.int32, device=device)
    plan = tk.make_plan(1, T, cu, torch.device(device))
    q, k = (torch.nn.functional.normalize(torch.randn(T, H, K), dim=-1) for _ in range(2))
    G = tk.chunk_cumsum(torch.nn.functional.logsigmoid(torch.randn(T, H, K)).to(device), plan)
    M = torch.randn(T, H, tk.BT)
    return plan, q, k, G, M


def _close(got, want, what):
    # tf32 products (truncated to 10 mantissa bits on the CPU): ~1e-3 normwise either route
    err = ((got.cpu().double() - want).norm() / want.norm()).item()
    assert err < 4e-3, f"{what}: normwise error {err:.2e}"


@pytest.mark.parametrize("route", ["whole", "blocks"])
def test_stage9b_each_route_matches_its_definition(route, device, seed):
    from tileport.ops.kda import triton_kernels as kk

    plan, q, k, G, dP = _pair_inputs(device)
    H = q.shape[1]
    parts = [torch.randn_like(q) for _ in range(3)]  # 9's dQ', dK', dG' partials
    got = [x.clone().to(device) for x in parts]
    flags = torch.full((plan.NC, H), 0 if route == "whole" else 1, dtype=torch.int8, device=device)
    kk.chunk_dp_apply_kda(dP.to(device), q.to(device), k.to(device), G, *got, plan, torch.bfloat16, span_flags=flags)
    R, C = gated_pair_reference(dP, k, q, G.cpu(), plan.chunks.cpu())
    pos = torch.cat([torch.arange(min(e - b, tk.BT)) for b, e in plan.chunks.view(-1, 2).tolist()])
    d = dP.double().gather(2, pos[:, None, None].expand(-1, H, 1))  # dP_tt
    qd, kd = q.double(), k.double()
    for name, g_, want in zip(("dq", "dk", "dG"), got, (parts[0] + R + d * kd, parts[1] + C + d * qd,
                                                           parts[2] + qd * R - kd * C)):
        _close(g_, want, f"9b by {route}: {name}")


@pytest.mark.parametrize("route", ["whole", "blocks"])
def test_stage10b_each_route_matches_its_definition(route, device, seed):
    from tileport.ops.kda import triton_kernels as kk

    plan, _, k, G, dA = _pair_inputs(device)
    T, H, K = k.shape
    beta = torch.rand(T, H)
    dkp, dGp, dbp = torch.randn(T, H, K), torch.randn(T, H, K), torch.randn(T, H)
    flags = torch.full((plan.NC, H), 0 if route == "whole" else 1, dtype=torch.int8, device=device)
    dk, dbeta, dg = kk.chunk_da_apply_kda(*(x.to(device) for x in (dA, k, beta)), G,
                                          *(x.to(device) for x in (dkp, dGp, dbp)), plan, torch.float32,
                                          torch.float32, torch.float32, torch.bfloat16, span_flags=flags)
    kd, bd = k.double(), beta.double()[..., None]
    R, C = gated_pair_reference(dA, k, bd * kd, G.cpu(), plan.chunks.cpu())
    dG = dGp.double() + bd * kd * R - kd * C
    dg_want = torch.cat([dG[b:b + min(e - b, tk.BT)].flip(0).cumsum(0).flip(0)
                         for b, e in plan.chunks.view(-1, 2).tolist()])
    _close(dk, dkp.double() + bd * R + C, f"10b by {route}: dk")
    _close(dbeta, dbp.double() + (kd * R).sum(-1), f"10b by {route}: dbeta")
    _close(dg, dg_want, f"10b by {route}: dg")


def _route_flags(kind: str, plan, H: int, device) -> torch.Tensor:
    """int8 [NC, H] flags: every chunk unflagged ("whole"), every chunk flagged, or a fixed mix."""
    if kind == "mixed":
        return (torch.arange(plan.NC * H) % 3 == 1).to(torch.int8).view(plan.NC, H).to(device)
    return torch.full((plan.NC, H), 0 if kind == "whole" else 1, dtype=torch.int8, device=device)


def _same(got, want, what):
    # the fused kernels form the same products and sum them in the unfused order, so only fp32
    # rounding (contractions, a sum over key blocks) may differ; a missing or doubled pair term is O(1)
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 1e-5, f"{what}: normwise difference {err:.2e} from the unfused launches"


@pytest.mark.parametrize("kind", ["whole", "flagged", "mixed"])
def test_stage9_with_9b_fused_matches_9_then_9b(kind, device, seed, monkeypatch):
    from tileport.ops.kda import triton_kernels as kk

    monkeypatch.setattr(tk, "DQKWG_KEY_BLOCK", 32)  # K = 64 in two key blocks: two dP slices
    plan, q, k, G, _ = _pair_inputs(device, K=64)
    T, H, K = q.shape
    V = 32
    h, dh = torch.randn(plan.NC, H, K, V), torch.randn(plan.NC, H, K, V)
    vn, dvn, do = torch.randn(T, H, V), torch.randn(T, H, V), torch.randn(T, H, V).to(torch.bfloat16)
    q, k, h, dh, vn, dvn, do = (x.to(device) for x in (q, k, h, dh, vn, dvn, do))
    flags = _route_flags(kind, plan, H, device)
    want = kk.chunk_dqkwg_kda(q, k, G, h, dh, vn, dvn, do, 0.125, plan, torch.bfloat16)
    kk.chunk_dp_apply_kda(want[4], q, k, G, want[0], want[1], want[3], plan, torch.bfloat16, span_flags=flags)
    got = kk.chunk_dqkwg_kda(q, k, G, h, dh, vn, dvn, do, 0.125, plan, torch.bfloat16, span_flags=flags,
                             fuse_9b=True)
    kk.chunk_dp_apply_kda(got[4], q, k, G, got[0], got[1], got[3], plan, torch.bfloat16, span_flags=flags,
                          whole=False)
    for name, a, b in zip(("dQ", "dK'", "dW", "dG'"), got, want):
        _same(a, b, f"9 with 9b fused ({kind} chunks): {name}")


@pytest.mark.parametrize("kind", ["whole", "flagged", "mixed"])
def test_stage10_with_10b_fused_matches_10_then_10b(kind, device, seed):
    from tileport.ops.kda import triton_kernels as kk

    plan, _, k, G, Ai = _pair_inputs(device, K=128)  # two blocks of 64 key channels
    T, H, K = k.shape
    V = 32
    v, u, dvn = torch.randn(T, H, V).to(torch.bfloat16), torch.randn(T, H, V), torch.randn(T, H, V)
    beta = torch.rand(T, H).to(torch.bfloat16)
    w, dw, dkp, dGp = (torch.randn(T, H, K) for _ in range(4))
    k, v, beta, Ai, w, u, dw, dvn = (x.to(device) for x in (k, v, beta, Ai, w, u, dw, dvn))
    flags = _route_flags(kind, plan, H, device)
    # dk, dbeta, dg in fp32: the fused route sums dbeta's terms in another order, and a bf16 dbeta
    # could round one element a step apart (2e-4 normwise), which is not what this test is about
    dtypes = (torch.float32, torch.float32, torch.float32)

    def run(fused: bool):
        dk_, dG_ = dkp.clone().to(device), dGp.clone().to(device)
        outputs_10b = kk._da_apply_outputs(k, *dtypes) if fused else None
        da, dbp, dv = kk.chunk_wy_bwd_kda(k, v, beta, G, Ai, w, u, dw, dvn, dk_, dG_, plan, torch.bfloat16,
                                          torch.bfloat16, span_flags=flags, outputs_10b=outputs_10b)
        return (dv, *kk.chunk_da_apply_kda(da, k, beta, G, dk_, dG_, dbp, plan, *dtypes, torch.bfloat16,
                                           span_flags=flags, outputs_10b=outputs_10b))

    for name, a, b in zip(("dv", "dk", "dbeta", "dg"), run(True), run(False)):
        _same(a, b, f"10 with 10b fused ({kind} chunks): {name}")


def test_fused_stages_need_the_flags(device):
    from tileport.ops.kda import triton_kernels as kk

    plan, q, k, G, M = _pair_inputs(device)
    with pytest.raises(ValueError, match="fuse_9b needs span_flags"):
        kk.chunk_dqkwg_kda(q, k, G, None, None, None, None, None, 0.125, plan, torch.bfloat16, fuse_9b=True)
    with pytest.raises(ValueError, match="outputs_10b needs span_flags"):
        kk.chunk_wy_bwd_kda(k, k, None, G, M, k, k, k, k, k, k, plan, torch.bfloat16, torch.bfloat16,
                            outputs_10b=(k, k, k))
