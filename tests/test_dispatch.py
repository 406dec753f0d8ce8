"""Dispatch: preference order, forcing, disabling, strict mode, explain, caching, torch.compile."""

import os
import subprocess
import sys
import time

import pytest
import torch

import tileport
from tileport.dispatch import Backend, BackendRefused, OpDispatcher
from tileport.ops.attnres import DISPATCHER


def toy_dispatcher():
    calls = []

    def refuse_big(call):
        calls.append(call)
        return "n too big" if call > 10 else None

    backends = [
        Backend("fast", lambda: None, refuse_big, "FAST", devices=("cpu",)),
        Backend("broken", lambda: "missing library xyz", lambda c: None, "BROKEN", devices=("cpu",)),
        Backend("reference", lambda: None, lambda c: None, "REF", devices=("cpu",)),
    ]
    return OpDispatcher("toy", backends, signature=lambda c: c), calls


def test_preference_and_fallback_with_reasons():
    d, _ = toy_dispatcher()
    assert d.choose(5, "cpu").impl == "FAST"
    assert d.choose(50, "cpu").impl == "REF"
    text = d.explain(50, "cpu")
    assert "n too big" in text and "missing library xyz" in text and "runs: reference" in text


def test_decisions_are_cached():
    d, calls = toy_dispatcher()
    d.choose(3, "cpu")
    d.choose(3, "cpu")
    assert len(calls) == 1


def test_forced_backend_refusal_raises(monkeypatch):
    d, _ = toy_dispatcher()
    monkeypatch.setenv("TILEPORT_TOY_BACKEND", "fast")
    assert d.choose(5, "cpu").impl == "FAST"
    with pytest.raises(BackendRefused, match="n too big"):
        d.choose(50, "cpu")
    monkeypatch.setenv("TILEPORT_TOY_BACKEND", "broken")
    with pytest.raises(BackendRefused, match="missing library xyz"):
        d.choose(5, "cpu")
    monkeypatch.setenv("TILEPORT_TOY_BACKEND", "nope")
    with pytest.raises(BackendRefused, match="unknown backend"):
        d.choose(5, "cpu")


def test_global_force_and_op_force_precedence(monkeypatch):
    d, _ = toy_dispatcher()
    monkeypatch.setenv("TILEPORT_BACKEND", "reference")
    assert d.choose(5, "cpu").impl == "REF"
    monkeypatch.setenv("TILEPORT_TOY_BACKEND", "fast")
    assert d.choose(5, "cpu").impl == "FAST"


def test_disable_and_strict(monkeypatch):
    d, _ = toy_dispatcher()
    monkeypatch.setenv("TILEPORT_DISABLE", "fast")
    assert d.choose(5, "cpu").impl == "REF"
    monkeypatch.delenv("TILEPORT_DISABLE")
    monkeypatch.setenv("TILEPORT_STRICT", "1")
    with pytest.raises(BackendRefused, match="TILEPORT_STRICT"):
        d.choose(50, "cpu")


def test_attnres_forced_triton_on_plain_cpu_says_how(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TILEPORT_ATTNRES_BACKEND", "triton")
    D = 16
    with pytest.raises(BackendRefused, match="TRITON_INTERPRET"):
        tileport.fused_attnres(torch.randn(D), [torch.randn(2, D)], torch.ones(D))


def test_attnres_gluon_refused_on_cpu_with_reason(monkeypatch):
    monkeypatch.setenv("TILEPORT_ATTNRES_BACKEND", "gluon")
    D = 16
    with pytest.raises(BackendRefused, match="gluon"):
        tileport.fused_attnres(torch.randn(D), [torch.randn(2, D)], torch.ones(D))


def test_dispatch_overhead_is_small():
    """The cached decision costs microseconds (a dict lookup), not milliseconds."""
    from tileport.ops.attnres import _describe

    D = 64
    res = tuple(torch.randn(4, D) for _ in range(8))
    q = torch.randn(D)
    DISPATCHER.choose(_describe(q, res), "cpu")
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        DISPATCHER.choose(_describe(q, res), "cpu")
    per_call_us = (time.perf_counter() - t0) / n * 1e6
    assert per_call_us < 200, per_call_us  # generous for a loaded 2-core CI box; typically ~10 us


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_explain_cli_lists_every_backend(interpret):
    # on a CPU machine: why Gluon and compiled Triton don't apply, and what runs instead
    env = dict(os.environ, TRITON_INTERPRET=interpret, CUDA_VISIBLE_DEVICES="")
    for var in ("TILEPORT_BACKEND", "TILEPORT_ATTNRES_BACKEND", "TILEPORT_STRICT"):
        env.pop(var, None)
    out = subprocess.run(
        [sys.executable, "-m", "tileport", "explain", "attnres", "--dtype", "bf16", "--device", "cpu", "--shape", "8,16384,2048"],
        capture_output=True, text=True, check=True, env=env,
    ).stdout
    gluon = next(line for line in out.splitlines() if " gluon " in line)
    triton = next(line for line in out.splitlines() if " triton " in line)
    assert "Hopper" in gluon and "n/a" in gluon, out
    if interpret == "0":
        assert "TRITON_INTERPRET=1" in triton and "n/a" in triton, out
        assert out.strip().endswith("runs: reference"), out
    else:
        assert "accepts" in triton, out
        assert out.strip().endswith("runs: triton"), out


class _Block(torch.nn.Module):
    def __init__(self, D):
        super().__init__()
        self.query = torch.nn.Parameter(torch.randn(D) / D**0.5)
        self.w = torch.nn.Parameter(torch.rand(D) + 0.5)
        self.ow = torch.nn.Parameter(torch.rand(D) + 0.5)

    def forward(self, xs):
        h = [torch.tanh(x) for x in xs]
        return tileport.fused_attnres(self.query, h, self.w, self.ow) * 2.0


def test_torch_compile_fullgraph_matches_eager(tmp_path, monkeypatch):
    # a private inductor cache: a compiled graph cached by an older tileport would be reused
    # (same op schema) with stale fake shapes
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    torch.manual_seed(0)
    D = 32
    m = _Block(D)
    xs = [torch.randn(3, 5, D, requires_grad=True) for _ in range(4)]
    eager = m(xs)
    g_eager = torch.autograd.grad(eager.sum(), [m.query, m.w, m.ow, *xs])
    compiled = torch.compile(m, fullgraph=True)
    out = compiled(xs)
    g_comp = torch.autograd.grad(out.sum(), [m.query, m.w, m.ow, *xs])
    torch.testing.assert_close(out, eager)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b)


def _backward_on_another_thread(out, leaves):
    """torch.autograd.grad of out.sum() on a fresh thread: where autograd runs a CUDA backward (its
    device thread), without the caller's thread-local `use_backend` settings."""
    import threading

    result = {}

    def run():
        result["grads"] = torch.autograd.grad(out.float().sum(), leaves, allow_unused=True)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return result["grads"]


def _choices_seen(monkeypatch, dispatcher):
    """Record the forced backends in effect at each of the dispatcher's choices."""
    from tileport.dispatch import forced_backends

    seen = []
    choose = dispatcher.choose

    def spy(*args, **kwargs):
        seen.append(forced_backends())
        return choose(*args, **kwargs)

    monkeypatch.setattr(dispatcher, "choose", spy)
    return seen


@pytest.mark.parametrize("path", ["function", "custom_op", "compiled"])
def test_forced_backend_reaches_a_backward_on_another_thread(path, monkeypatch):
    """A backend forced around the forward is forced in its backward too, wherever autograd runs
    it: the backward of CUDA tensors runs on autograd's device thread, where `use_backend`'s
    thread-local setting was absent (the H200 bench's "triton" backward rows timed gluon's). Every
    autograd path: the op's autograd.Function (eager), the torch.library op called directly, and
    the op under torch.compile (whose backward op runs after the trace, as its argument says)."""
    from tileport.ops.rms_norm import DISPATCHER as RMS

    torch._dynamo.reset()
    seen = _choices_seen(monkeypatch, RMS)
    x = torch.randn(4, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    forward = {"function": tileport.rms_norm, "custom_op": lambda x, w: torch.ops.tileport.rms_norm_forward(x, w, 1e-6),
               "compiled": torch.compile(lambda x, w: tileport.rms_norm(x, w), fullgraph=True, backend="aot_eager")}
    with tileport.use_backend("reference", op="rms_norm"):
        y = forward[path](x, w)
    assert seen and all(s == {"rms_norm": "reference"} for s in seen)
    seen.clear()
    dx, dw = _backward_on_another_thread(y, [x, w])
    assert dx is not None and dw is not None
    assert seen == [{"rms_norm": "reference"}], seen  # the backward's choice, under the forward's setting


def test_forced_backend_reaches_a_delta_rule_backward_on_another_thread(monkeypatch):
    """The same for the delta-rule ops' shared autograd (GDN here; KDA runs the same code)."""
    from tileport.ops.gdn import DISPATCHER as GDN

    seen = _choices_seen(monkeypatch, GDN)
    B, T, H, K = 1, 8, 1, 16
    q, k, v = (torch.randn(B, T, H, K, dtype=torch.float64, requires_grad=True) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, dtype=torch.float64)).requires_grad_(True)
    beta = torch.rand(B, T, H, dtype=torch.float64, requires_grad=True)
    with tileport.use_backend("reference", op="gdn"):
        o, _ = tileport.chunk_gated_delta_rule(q, k, v, g, beta)
    seen.clear()
    grads = _backward_on_another_thread(o, [q, k, v, g, beta])
    assert all(gr is not None for gr in grads)
    assert seen and all(s == {"gdn": "reference"} for s in seen), seen
    from tileport.dispatch import forced_backends
    assert forced_backends() == {}  # nothing leaks into this thread after the block


def test_forced_backend_reaches_a_compiled_delta_rule_backward_on_another_thread(monkeypatch):
    """Under torch.compile the op's backward function runs once, when AOTAutograd traces it, and
    the backward custom op it records runs later on autograd's thread: the forward's forced
    backends reach it as the op's argument (on the H200 a KDA backward compiled under
    use_backend("triton") ran the gluon backend's before they did)."""
    from tileport.dispatch import forced_backends
    from tileport.ops.gdn import DISPATCHER as GDN

    torch._dynamo.reset()
    seen = _choices_seen(monkeypatch, GDN)
    B, T, H, K = 1, 8, 1, 16
    q, k, v = (torch.randn(B, T, H, K, dtype=torch.float64, requires_grad=True) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, dtype=torch.float64)).requires_grad_(True)
    beta = torch.rand(B, T, H, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, g, beta):
        return tileport.chunk_gated_delta_rule(q, k, v, g, beta)[0]

    with tileport.use_backend("reference", op="gdn"):
        o = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, g, beta)
    assert seen and all(s == {"gdn": "reference"} for s in seen), seen
    seen.clear()
    grads = _backward_on_another_thread(o, [q, k, v, g, beta])
    assert all(gr is not None for gr in grads)
    assert seen and all(s == {"gdn": "reference"} for s in seen), seen
    assert forced_backends() == {}
