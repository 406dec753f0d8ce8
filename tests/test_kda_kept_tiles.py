"""What KDA's forward keeps for its backward (`triton_kernels.KEEP_FORWARD_TILES`, docs/perf/kda.md
row 19): which path runs when. The values are the frozen gate's business (tests/test_kda_parity.py
runs the kept path, the default; tests/test_kda_forms.py "recompute-stage3" the recompute): here,
that an eager call autograd will differentiate keeps G, T and the flags and that its backward then
forms W and U from T instead of running stage 3; that a call without gradients keeps nothing; that
what is kept is saved like the inputs (freed by the backward); that torch.compile's path (custom
ops) recomputes; and that the two backwards agree."""

from __future__ import annotations

import pytest
import test_kda_parity as parity
import torch
from test_kda_parity import _one_thread  # noqa: F401 (autouse fixture)

import tileport
from tileport.dispatch import use_backend
from tileport.ops.kda import triton_kernels as kk

# 130 tokens: two whole chunks and a 2-token tail; the gate's "mixed" gates (30% of entries at
# -20..-30) span too far in the whole chunks, so stage 3 flags those (16-row blocks) and takes the
# tail as one tile: both routes of T, W and U
CASE = (1, 130, 2, 64, 64, torch.bfloat16)


def _inputs(device, l2):
    B, T, H, K, V, dtype = CASE
    q, k, v, g, beta, _, _ = parity.make_inputs(B, T, H, K, V, dtype, None, False, l2, "mixed", "rand", device)
    for t in (q, k, v, g, beta):
        t.requires_grad_(True)
    return q, k, v, g, beta


def _spy(monkeypatch):
    """Record each stage-3 launch's store_T / exact_wu and each W-from-T call."""
    calls = []
    solve, from_t = kk.chunk_solve_wu, kk.chunk_wu_from_t_kda

    def solve_spy(*args, **kwargs):
        calls.append(("solve", kwargs.get("store_T", False), kwargs.get("exact_wu", False)))
        return solve(*args, **kwargs)

    def from_t_spy(*args, **kwargs):
        calls.append(("from_t",))
        return from_t(*args, **kwargs)

    monkeypatch.setattr(kk, "chunk_solve_wu", solve_spy)
    monkeypatch.setattr(kk, "chunk_wu_from_t_kda", from_t_spy)
    return calls


@pytest.mark.parametrize("l2", [False, True])
def test_eager_backward_takes_the_forward_tiles(l2, device, seed, monkeypatch):
    parity._backend_or_skip("triton", device)
    calls = _spy(monkeypatch)
    q, k, v, g, beta = _inputs(device, l2)
    with use_backend("triton", op="kda"):
        o, _ = tileport.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=l2)
        assert calls == [("solve", True, False)], calls  # the forward stored T (at its own precisions)
        do = torch.randn_like(o)
        kept_grads = torch.autograd.grad(o, (q, k, v, g, beta), do)
    assert calls == [("solve", True, False), ("from_t",)], calls  # no stage 3 in the backward
    # the recompute's gradients of the same call
    monkeypatch.setattr(kk, "KEEP_FORWARD_TILES", False)
    calls.clear()
    with use_backend("triton", op="kda"):
        o2, _ = tileport.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=l2)
        grads = torch.autograd.grad(o2, (q, k, v, g, beta), do)
    assert calls == [("solve", False, False), ("solve", True, True)], calls
    assert torch.equal(o, o2)  # keeping T does not change the forward
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], kept_grads, grads):
        assert torch.isfinite(a).all(), name
        rel = float((a.double() - b.double()).norm() / b.double().norm())
        # without l2norm the same T (the forward's precisions are the recompute's there) and each
        # route's W and U at the recompute's precision, the flagged chunks' as one product rather
        # than the block kernel's sums over 16-row blocks: summation order only, ~2e-5 after the
        # backward; with it the forward's T comes from bf16 keys and bf16 products, ~1e-3 (each
        # within the gate's bounds of the float64 reference: tests/test_kda_parity.py)
        assert rel <= (1e-4 if not l2 else 5e-3), (name, rel)


@pytest.mark.parametrize("backend", ["triton", "gluon"])
@pytest.mark.parametrize("normalised_qk", ["input", "fp32"])
def test_backward_takes_the_forward_normalised_keys(normalised_qk, backend, device, seed, monkeypatch):
    """With l2norm the forward keeps the normalised keys it used (KeptTiles.kn, in the inputs' dtype:
    `l2norm_fwd`'s, or on the gluon backend stage 3's); a backward whose own normalised keys would
    be in that dtype (BACKWARD_NORMALISED_QK "input") takes them and normalises q alone, with
    gradients bitwise those of normalising k again; with fp32 ones ("fp32") it normalises both."""
    parity._backend_or_skip(backend, device)
    from tileport.ops.kda import gluon_kernels as kg

    forward, backward = ((kk.kda_forward_triton, kk.kda_backward_triton) if backend == "triton"
                         else (kg.kda_forward_gluon, kg.kda_backward_gluon))
    monkeypatch.setattr(kk, "BACKWARD_NORMALISED_QK", normalised_qk)
    q, k, v, g, beta = _inputs(device, True)
    o, ht, kept = forward(q, k, v, g, beta, 64 ** -0.5, None, False, True, None, keep_for_backward=True)
    assert kept.kn is not None and kept.kn.dtype == k.dtype and kept.kn.shape == (130, 2, 64)
    norms = []
    real = kk.l2norm_fwd
    monkeypatch.setattr(kk, "l2norm_fwd", lambda x, *a: norms.append(x.data_ptr()) or real(x, *a))
    do = torch.randn_like(o)
    args = (do, None, q, k, v, g, beta, 64 ** -0.5, None, True, None)
    got = backward(*args, kept=kept)
    taken = normalised_qk == "input"
    assert len(norms) == (1 if taken else 2), norms  # q's alone where the kept keys are taken
    want = backward(*args, kept=kept._replace(kn=None))
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], got, want):
        assert torch.equal(a, b), name


def test_kept_tiles_are_saved_tensors(device, seed):
    """What the forward kept lives in the autograd graph's saved tensors, not as a ctx attribute:
    freed by the backward (a second backward through the graph is refused, as for any op)."""
    parity._backend_or_skip("triton", device)
    q, k, v, g, beta = _inputs(device, False)
    with use_backend("triton", op="kda"):
        o, _ = tileport.chunk_kda(q, k, v, g, beta)
    node = o.grad_fn
    while node is not None and "KDA" not in type(node).__name__:
        node = node.next_functions[0][0]
    assert node is not None and node.kept_backend == "triton" and node.kept is None
    # q, k, v, g, beta, then G, T, the flags, h and Vn (None: Triton's forward stores no states) and
    # the normalised keys (None: no l2norm here)
    assert len(node.saved_tensors) == 5 + 6 and node.saved_tensors[-3:] == (None, None, None)
    o.float().sum().backward()
    with pytest.raises(RuntimeError):
        node.saved_tensors  # noqa: B018 -- freed after the backward


def test_no_grad_forward_keeps_nothing(device, seed, monkeypatch):
    parity._backend_or_skip("triton", device)
    calls = _spy(monkeypatch)
    q, k, v, g, beta = _inputs(device, False)
    with use_backend("triton", op="kda"), torch.no_grad():
        tileport.chunk_kda(q, k, v, g, beta)
    assert calls == [("solve", False, False)], calls
    calls.clear()
    with use_backend("triton", op="kda"):  # no input requires a gradient
        tileport.chunk_kda(*(t.detach() for t in (q, k, v, g, beta)))
    assert calls == [("solve", False, False)], calls


def test_fp32_inputs_recompute(device, seed, monkeypatch):
    """fp32 inputs take the 16-row blocks (no flags): nothing is kept, the backward recomputes."""
    parity._backend_or_skip("triton", device)
    calls = _spy(monkeypatch)
    q, k, v, g, beta = (t.detach().float().requires_grad_(True) for t in _inputs(device, False))
    with use_backend("triton", op="kda"):
        o, _ = tileport.chunk_kda(q, k, v, g, beta)
        torch.autograd.grad(o, (q, k, v, g, beta), torch.randn_like(o))
    assert ("from_t",) not in calls and calls[-1] == ("solve", True, True), calls


def test_torch_compile_recomputes_and_matches_eager(device, seed, monkeypatch):
    """Under torch.compile (fullgraph; the aot_eager backend, which runs on the CPU too) the op is
    the custom ops and nothing is kept: the backward runs stage 3 again, and its gradients are the
    eager recompute's: bitwise under the interpreter. On the H200 the gradients differed (up to
    9.3e-5 normwise at TILEPORT_SEED=1159707647) until the twenty-fourth session: the compiled
    backward ran on autograd's device thread without the forced "triton", so on the gluon backend's
    kernels (the backward custom op now takes the forward's forced backends: docs/perf/kda.md). So o
    bitwise, the gradients within 1e-6 normwise: far below the kept path's distance from the
    recompute (3e-5 to 1.3e-3, docs/perf/kda.md row 19), which a compiled call that kept tiles would
    show."""
    parity._backend_or_skip("triton", device)
    monkeypatch.setattr(kk, "KEEP_FORWARD_TILES", False)  # eager recomputes too: the same kernels
    q, k, v, g, beta = _inputs(device, True)

    def f(q, k, v, g, beta):
        return tileport.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

    torch._dynamo.reset()
    with use_backend("triton", op="kda"):
        eager = f(q, k, v, g, beta)
        do = torch.randn_like(eager)
        g_eager = torch.autograd.grad(eager, (q, k, v, g, beta), do)
        calls = _spy(monkeypatch)
        monkeypatch.setattr(kk, "KEEP_FORWARD_TILES", True)
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, g, beta)
        g_comp = torch.autograd.grad(out, (q, k, v, g, beta), do)
    assert calls == [("solve", False, False), ("solve", True, True)], calls
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), g_comp, g_eager):
        err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
        assert err <= 1e-6, f"{name}: the compiled path's gradient is {err:.2e} normwise from the eager recompute's"


def test_custom_op_path_recomputes(device, seed, monkeypatch):
    """The torch.compile path (the custom ops, called directly here) keeps nothing: its backward
    runs stage 3 again."""
    parity._backend_or_skip("triton", device)
    calls = _spy(monkeypatch)
    q, k, v, g, beta = _inputs(device, False)
    with use_backend("triton", op="kda"):
        o, _ = torch.ops.tileport.kda_forward(q, k, v, g, beta, None, None, 0.125, False, False)
        torch.autograd.grad(o, (q, k, v, g, beta), torch.randn_like(o))
    assert calls == [("solve", False, False), ("solve", True, True)], calls
