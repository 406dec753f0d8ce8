"""`tileport bench` on the CPU: floor formulas, the JSON record's schema, and the refuses path."""

import json
import subprocess
import sys
import types

import pytest
import torch

from tileport import bench
from tileport.ops.attnres import perf as attnres_perf


def test_attnres_minimal_bytes():
    shape = dict(L=8, N=16384, D=2048)
    assert attnres_perf.minimal_cost(shape, 2, "fwd")[0] == 9 * 16384 * 2048 * 2
    assert attnres_perf.minimal_cost(shape, 2, "bwd")[0] == 17 * 16384 * 2048 * 2
    assert attnres_perf.minimal_cost(shape, 2, "fwdbwd")[0] == 26 * 16384 * 2048 * 2
    # SPEC's anchor: 604 MB at 4.25 TB/s is a 0.142 ms floor.
    assert abs(attnres_perf.minimal_cost(shape, 2, "fwd")[0] / 4.25e12 * 1e3 - 0.1421) < 1e-3


def _fake_suite(systems):
    m = types.SimpleNamespace()
    m.SMALL = m.STANDARD = [dict(N=8, D=4)]
    m.minimal_cost = lambda shape, e, mode: (2 * shape["N"] * shape["D"] * e, shape["N"] * shape["D"])
    m.make_inputs = lambda shape, dtype, device, torch: dict(x=torch.randn(shape["N"], shape["D"], dtype=dtype))
    m.differentiable = lambda inp: [inp["x"]]
    m.reference = lambda inp: inp["x"].double() * 2
    m.systems = lambda torch: systems
    return m


def _args(**kw):
    base = dict(op="fake", backends="good,wrong,refuser", shapes="small", modes="fwd,fwdbwd", dtype="fp32",
                json=None, plot=None, base=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_refuses_fail_and_ok_rows(monkeypatch):
    def refuser(inp):
        raise RuntimeError("refusing on purpose: wrong gradients on this stack")

    suite = _fake_suite({"good": lambda inp: inp["x"] * 2, "wrong": lambda inp: inp["x"] * 3, "refuser": refuser})
    monkeypatch.setitem(sys.modules, "fake_suite", suite)
    monkeypatch.setitem(bench.OPS, "fake", "fake_suite")
    rows = bench.bench_op("fake", _args(), gpu=False, ceilings=dict(bench.NOMINAL), progress_total=[])
    by = {}
    for r in rows:
        by.setdefault(r["system"], []).append(r)
    assert [r["mode"] for r in by["good"]] == ["fwd", "fwdbwd"] and all(r["status"] == "ok" for r in by["good"])
    assert by["wrong"][0]["status"].startswith("FAIL parity")  # never timed
    assert by["refuser"][0]["status"].startswith("refuses: RuntimeError: refusing on purpose")
    good = by["good"][0]
    assert good["bytes"] == 2 * 8 * 4 * 4 and good["floor_ms"] > 0 and 0 < good["frac_floor"]


def test_backward_refusal_keeps_the_forward(monkeypatch):
    """FLA refuses GDN's backward on Hopper: its forward must still be verified and timed, its
    backward modes reported as refusals; a system listed in NO_KERNEL_BACKWARD is timed forward only."""

    class RefusesBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("wrong gradients on this stack, refusing")

    calls = []

    def slow_backward(inp):
        calls.append("fwd")
        return inp["x"] * 2

    suite = _fake_suite({"fwdonly": lambda inp: RefusesBackward.apply(inp["x"]), "nokernel": slow_backward})
    suite.NO_KERNEL_BACKWARD = {"nokernel": "its backward is the reference"}
    monkeypatch.setitem(sys.modules, "fake_suite3", suite)
    monkeypatch.setitem(bench.OPS, "fake3", "fake_suite3")
    rows = bench.bench_op("fake3", _args(op="fake3", backends="fwdonly,nokernel", modes="fwd,bwd,fwdbwd"), gpu=False,
                          ceilings=dict(bench.NOMINAL), progress_total=[])
    status = {(r["system"], r["mode"]): r["status"] for r in rows}
    assert status[("fwdonly", "fwd")] == "ok" and status[("nokernel", "fwd")] == "ok", status
    for mode in ("bwd", "fwdbwd"):
        assert status[("fwdonly", mode)].startswith("refuses: RuntimeError: wrong gradients"), status
        assert status[("nokernel", mode)] == "n/a here: its backward is the reference", status


def test_cli_json_record_schema(tmp_path):
    out = tmp_path / "rec.json"
    env = dict(__import__("os").environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "tileport", "bench", "--op", "attnres", "--backends", "triton,fla,gluon",
                           "--modes", "fwd", "--json", str(out)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "times mean NOTHING" in proc.stdout
    rec = json.loads(out.read_text())
    assert rec["schema"] == 1 and rec["gpu"] is False
    for key in ("torch", "triton", "date", "commit", "gpu"):
        assert key in rec["machine"]
    assert {"copy_tbps", "matmul_tflops"} <= set(rec["ceilings"])
    systems = {r["system"]: r for r in rec["rows"]}
    assert systems["triton"]["status"] == "ok"
    for key in ("ms", "p20", "p80", "tbps", "frac_floor", "bytes", "flops", "floor_ms", "rel_err"):
        assert key in systems["triton"]
    assert systems["gluon"]["status"].startswith("n/a here:")
    assert systems["fla"]["status"].startswith(("unavailable:", "refuses:", "ok"))


def test_forced_backend_also_runs_the_backward(monkeypatch):
    """A system named after one of our backends must run its backward on that backend too (the
    backward dispatches when autograd calls it, outside the system's forward call)."""
    from tileport.dispatch import REGISTRY, Backend, OpDispatcher

    used = []

    def impl(name):
        return name

    disp = OpDispatcher("fakeop", [
        Backend("fast", lambda: None, lambda c: None, "fast", devices=("cpu",)),
        Backend("slow", lambda: None, lambda c: None, "slow", devices=("cpu",)),
    ], signature=lambda c: c)
    monkeypatch.setitem(REGISTRY, "fakeop", disp)

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            used.append(("fwd", disp.choose(0, "cpu").impl))
            return x * 2

        @staticmethod
        def backward(ctx, g):
            used.append(("bwd", disp.choose(0, "cpu").impl))
            return g * 2

    suite = _fake_suite({"slow": lambda inp: Double.apply(inp["x"])})
    monkeypatch.setitem(sys.modules, "fake_suite2", suite)
    monkeypatch.setitem(bench.OPS, "fakeop", "fake_suite2")
    rows = bench.bench_op("fakeop", _args(op="fakeop", backends="slow", modes="fwdbwd"), gpu=False,
                          ceilings=dict(bench.NOMINAL), progress_total=[])
    assert rows[0]["status"] == "ok", rows
    assert ("bwd", "slow") in used and ("bwd", "fast") not in used, used


def test_warm_op_calls_every_system_forward_and_backward(monkeypatch):
    calls = []

    def good(inp):
        calls.append("good")
        return inp["x"] * 2

    def refuser(inp):
        raise RuntimeError("no")

    monkeypatch.setitem(bench.OPS, "fake", "fake_suite")
    monkeypatch.setitem(sys.modules, "fake_suite", _fake_suite({"good": good, "refuser": refuser}))
    x_grads = []
    real_grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: x_grads.append(1) or real_grad(*a, **k))
    assert bench.warm_op("fake", _args(backends="good,refuser,missing"), gpu=False) == 1  # the refuser
    assert calls == ["good"] and x_grads == [1]  # forward, then its backward


def test_warm_up_runs_worker_processes_and_reports_failures(capsys, monkeypatch):
    # the workers run `tileport bench --warm-only` (here on the CPU, reference/interpreter, tiny
    # shapes), one per (op, system); a worker that fails is named, the others are not
    args = _args(backends="torch,triton", shapes="small", modes="fwd", dtype="fp32")
    # planned here like rms_norm, but unknown to the worker processes' CLI (rc 2)
    monkeypatch.setitem(bench.OPS, "not-an-op", "tileport.ops.rms_norm.perf")
    bench.warm_up(["rms_norm", "not-an-op"], args, workers=2)
    out = capsys.readouterr().out
    assert "4 (op, system) pairs" in out and "2 processes at a time" in out and "compiled in" in out
    assert "not-an-op/torch (rc 2" in out and "not-an-op/triton (rc 2" in out
    assert "rms_norm/" not in out.split("compiled in")[1]
