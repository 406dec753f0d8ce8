"""What KDA's forward keeps for its backward (`triton_kernels.KEEP_FORWARD_TILES`, docs/perf/kda.md
row 19): which path runs when. The values are the frozen gate's business (tests/test_kda_parity.py
runs the kept path, the default; tests/test_kda_forms.py "recompute-stage3" the recompute): here,
that an eager call autograd will differentiate keeps G, T and the flags and that its backward then
forms W and U from T instead of running stage 3; that a call without gradients keeps nothing; that
torch.compile's path (custom ops) recomputes; and that the two backwards agree."""

from __future__ import annotations

import pytest
import test_kda_parity as parity
import torch
from test_kda_parity import _one_thread  # noqa: F401 (autouse fixture)

import tileport
from tileport.dispatch import use_backend
from tileport.ops.kda import triton_kernels as kk

# 130 tokens (a partial last chunk), steep channels on head 0 so that some chunks are flagged
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
        kept_grads = torch.autograd.grad(o, (q, k, v, g, beta), torch.randn_like(o))
    assert calls == [("solve", True, False), ("from_t",)], calls  # no stage 3 in the backward
    # the recompute's gradients of the same call
    monkeypatch.setattr(kk, "KEEP_FORWARD_TILES", False)
    calls.clear()
    torch.manual_seed(seed)
    with use_backend("triton", op="kda"):
        o2, _ = tileport.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=l2)
        torch.manual_seed(seed + 1)
        do = torch.randn_like(o2)
        grads = torch.autograd.grad(o2, (q, k, v, g, beta), do)
    assert calls == [("solve", False, False), ("solve", True, True)], calls
    torch.manual_seed(seed + 1)
    monkeypatch.setattr(kk, "KEEP_FORWARD_TILES", True)
    with use_backend("triton", op="kda"):
        o3, _ = tileport.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=l2)
        kept_grads = torch.autograd.grad(o3, (q, k, v, g, beta), do)
    assert torch.equal(o2, o3)  # keeping T does not change the forward
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], kept_grads, grads):
        assert torch.isfinite(a).all(), name
        rel = float((a.double() - b.double()).norm() / b.double().norm())
        # without l2norm the same T (the forward's precisions are the recompute's there), W and U
        # of the flagged chunks as one tile product instead of the block kernel's: ~3e-5 apart;
        # with it the forward's T comes from bf16 keys and bf16 products: ~1e-3 apart (each
        # within the gate's bounds of the float64 reference: tests/test_kda_parity.py)
        assert rel <= (2e-4 if not l2 else 5e-3), (name, rel)


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
