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


# Every op's minimal bytes and flops at its first standard (anchor) shape, derived here from the
# list of tensors each mode must read and write once (bf16: 2 bytes; fp32 where the op keeps
# fp32: gates, cos/sin) and the matmuls it must do, independently of the ops' perf.py formulas.
def _numel(*shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _hand_costs():
    e, f32 = 2, 4
    M, D = 8192, 4096  # rms_norm, softmax, swiglu anchor
    md = _numel(M, D)
    rope_x, rope_cs = _numel(8, 4096, 32, 128), _numel(4096, 128)
    G, Mg, Kg, Ng = 8, 2048, 4096, 4096
    S = G * Mg
    B, T, H, K, V, C = 8, 4096, 16, 128, 128, 64
    tok = _numel(B, T, H)
    gdn_fwd_bytes = tok * (K + K + V + V) * e + tok * 2 * f32  # q, k, v, o; g, beta
    gdn_bwd_bytes = tok * (K + K + V + V) * e + tok * (K + K + V) * e + tok * 4 * f32  # + do; dq, dk, dv; dg, dbeta
    per_chunk = (2 * C * C * K        # k k^T
                 + 2 * C * C * K      # W = T (beta k)
                 + 2 * C * C * V      # U = T (beta v)
                 + 2 * C * K * V      # U - W h
                 + 2 * K * C * V      # h update
                 + 2 * C * K * V      # q h
                 + 2 * C * C * K      # q k^T
                 + 2 * C * C * V      # (q k^T) Vn
                 + C ** 3 // 3)       # the triangular solve
    gdn_fwd_flops = per_chunk * B * H * (T // C)
    kda_gate = tok * (K - 1) * f32  # per-channel g (and dg) instead of one per head
    return {
        ("rms_norm", "fwd"): ((2 * md + D) * e, 4 * md),  # x, y, weight
        ("rms_norm", "bwd"): ((3 * md + 2 * D) * e, 10 * md),  # x, dy, dx; weight, dweight
        ("softmax", "fwd"): (2 * md * e, 5 * md),  # x, y
        ("softmax", "bwd"): (3 * md * e, 4 * md),  # y, dy, dx
        ("swiglu", "fwd"): (3 * md * e, 5 * md),  # a, b, y
        ("swiglu", "bwd"): (5 * md * e, 10 * md),  # a, b, dy, da, db
        ("rope", "fwd"): (2 * rope_x * e + 2 * rope_cs * f32, 3 * rope_x),  # x, y; cos, sin
        ("rope", "fwdbwd"): (2 * (2 * rope_x * e + 2 * rope_cs * f32), 6 * rope_x),
        ("grouped_gemm", "fwd"): ((S * Kg + G * Kg * Ng + S * Ng) * e, 2 * S * Kg * Ng),  # A, B, C
        ("grouped_gemm", "bwd"): ((2 * S * Kg + 2 * G * Kg * Ng + S * Ng) * e, 4 * S * Kg * Ng),  # A, dA, B, dB, dC
        ("gdn", "fwd"): (gdn_fwd_bytes, gdn_fwd_flops),
        ("gdn", "fwdbwd"): (gdn_fwd_bytes + gdn_bwd_bytes, int(3.5 * gdn_fwd_flops)),
        ("kda", "fwd"): (gdn_fwd_bytes + kda_gate, gdn_fwd_flops),
        ("kda", "bwd"): (gdn_bwd_bytes + 2 * kda_gate, int(2.5 * gdn_fwd_flops)),
    }


HAND_COSTS = _hand_costs()


@pytest.mark.parametrize("op,mode", list(HAND_COSTS), ids=[f"{o}-{m}" for o, m in HAND_COSTS])
def test_floor_formulas_at_the_anchor(op, mode):
    import importlib

    perf = importlib.import_module(f"tileport.ops.{op}.perf")
    assert perf.minimal_cost(perf.STANDARD[0], 2, mode) == HAND_COSTS[(op, mode)]


def test_gdn_anchor_floor_matches_the_log():
    """docs/perf/gdn.md's floor table: 541 MB and 95.21 GFLOP forward at S1, 0.136 ms (flops-bound)."""
    from tileport.ops.gdn import perf as gdn_perf

    nbytes, flops = gdn_perf.minimal_cost(gdn_perf.STANDARD[0], 2, "fwd")
    assert round(nbytes / 1e6) == 541 and round(flops / 1e9, 2) == 95.21
    floor_ms = max(nbytes / (bench.NOMINAL["copy_tbps"] * 1e12), flops / (bench.NOMINAL["matmul_tflops"] * 1e12)) * 1e3
    assert round(floor_ms, 3) == 0.136


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
    assert good["bytes"] == 2 * 8 * 4 * 4 and 0 < good["frac_floor"]
    # the floor is max(bytes / copy bandwidth, flops / matmul rate), as a time
    expect = max(good["bytes"] / 4.25e12, good["flops"] / 700e12) * 1e3
    assert good["floor_ms"] == pytest.approx(expect, rel=1e-12)
    assert good["frac_floor"] == pytest.approx(good["floor_ms"] / good["ms"], rel=1e-12)
    # no CUDA activity to profile on the CPU: the kernel-time fields are there, empty
    assert good["kernel_ms"] is None and good["frac_floor_kernels"] is None and "kernel_error" not in good


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


def test_partial_record_keeps_the_systems_before_a_cut(tmp_path, monkeypatch):
    """A run cut while a system runs (the device call's time limit: here a KeyboardInterrupt from
    the second system) leaves a record with the first system's rows, marked partial."""
    def cut(inp):
        raise KeyboardInterrupt

    suite = _fake_suite({"good": lambda inp: inp["x"] * 2, "cut": cut})
    monkeypatch.setitem(sys.modules, "fake_suite_cut", suite)
    monkeypatch.setitem(bench.OPS, "fake_cut", "fake_suite_cut")
    out = tmp_path / "rec.json"
    args = _args(op="fake_cut", backends="good,cut", json=str(out), warm_workers=0)
    with pytest.raises(KeyboardInterrupt):
        bench.run(args)
    rec = json.loads(out.read_text())
    assert rec["partial"] is True
    assert [(r["system"], r["mode"], r["status"]) for r in rec["rows"]] == [("good", "fwd", "ok"), ("good", "fwdbwd", "ok")]


def test_cli_json_record_schema(tmp_path):
    out = tmp_path / "rec.json"
    env = dict(__import__("os").environ, TRITON_INTERPRET="1")
    # --kernel-times on: still no profiling on the CPU
    proc = subprocess.run([sys.executable, "-m", "tileport", "bench", "--op", "attnres", "--backends", "triton,fla,gluon",
                           "--modes", "fwd", "--kernel-times", "on", "--json", str(out)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "times mean NOTHING" in proc.stdout
    rec = json.loads(out.read_text())
    assert rec["schema"] == 1 and rec["gpu"] is False
    for key in ("torch", "triton", "date", "commit", "gpu"):
        assert key in rec["machine"]
    assert {"copy_tbps", "matmul_tflops"} <= set(rec["ceilings"])
    systems = {r["system"]: r for r in rec["rows"]}
    assert systems["triton"]["status"] == "ok"
    for key in ("ms", "p20", "p80", "tbps", "frac_floor", "bytes", "flops", "floor_ms", "rel_err", "graph_ms",
                "kernel_ms", "frac_floor_kernels"):
        assert key in systems["triton"]
    assert systems["triton"]["kernel_ms"] is None and systems["triton"]["graph_ms"] is None
    assert " kern " in proc.stdout  # the printed table's column, '-' here
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
    assert "slowest: " in out and " s, " in out.split("slowest: ")[1].split("\n")[0]  # where the time went
    assert "not-an-op/torch (rc 2" in out and "not-an-op/triton (rc 2" in out
    assert "rms_norm/" not in out.split("compiled in")[1]


def _row(system, ms, status="ok", mode="fwd"):
    return dict(op="x", shape=dict(N=8), mode=mode, system=system, ms=ms, status=status, frac_floor=0.5)


def test_plot_speedups_are_over_the_faster_baseline():
    rows = [_row("fla", 2.0), _row("torch", 1.0), _row("triton", 0.5), _row("gluon", 4.0),
            _row("fla", 1.0, status="refuses: no"), _row("triton", 1.0, mode="bwd"),  # bwd: no baseline ran
            _row("torch", 3.0, mode="fwdbwd"), _row("triton", 1.0, mode="fwdbwd", status="FAIL parity")]
    assert bench.speedups_over_baselines(rows) == {("x 8 fwd", "triton"): 2.0, ("x 8 fwd", "gluon"): 0.25}


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is not installed")
    out = tmp_path / "p.png"
    bench.plot([_row("torch", 1.0), _row("triton", 0.5)], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_extra_baselines_are_timed_by_default_and_count_as_baselines():
    """grouped GEMM's bar includes torch._grouped_mm: it is in the default systems, and the speedup
    panel treats every torch system (and FLA) as a baseline, never as tileport's."""
    _, _, _, _, _, systems, wanted = bench._op_plan("grouped_gemm", _args(op="grouped_gemm", backends=None), gpu=False)
    assert "torch_grouped_mm" in wanted and "torch_grouped_mm" in systems
    assert all(bench.is_baseline(s) for s in ("fla", "torch", "torch_grouped_mm", "torch_compile"))
    assert not any(bench.is_baseline(s) for s in ("triton", "gluon", "cutile", "gluon-devdesc"))


# --- the profiled kernel time ("kern") ---------------------------------------------------------
def _event(device, start, end, name="k", activity=None, annotation=False):
    """A stand-in for torch.profiler's FunctionEvent: the attributes device_kernel_us reads."""
    from torch.autograd import DeviceType

    dev = {"cuda": DeviceType.CUDA, "cpu": DeviceType.CPU}[device]
    return types.SimpleNamespace(name=name, device_type=dev, time_range=types.SimpleNamespace(start=start, end=end),
                                 activity_type=activity, is_user_annotation=annotation)


def _fake_profile_events(steps):
    """What `steps` profiled steps of a two-kernel backward leave: per step a 30 us and a 12.5 us
    kernel and a 2 us memset on the device, the host's launch calls and autograd ops around them,
    and, once, a GPU user annotation spanning every kernel (torch.compile's CompiledFxGraph)."""
    ev = [_event("cuda", 0.0, 1000.0, "CompiledFxGraph", activity="gpu_user_annotation", annotation=True)]
    for i in range(steps):
        t = 100.0 * i
        ev += [_event("cpu", t, t + 80, "autograd::engine::evaluate_function"),
               _event("cpu", t + 1, t + 4, "cudaLaunchKernel", activity="cuda_runtime"),
               _event("cuda", t + 10, t + 40, "bwd_dx_kernel", activity="kernel"),
               _event("cuda", t + 41, t + 53.5, "bwd_dw_kernel"),  # activity_type unknown (older torch)
               _event("cuda", t + 60, t + 62, "Memset (Device)", activity="gpu_memset")]
    return ev


def test_device_kernel_us_sums_device_kernels_only():
    # host events and the annotation (it spans the kernels: counting it would count them twice) are out
    assert bench.device_kernel_us(_fake_profile_events(4)) == pytest.approx(4 * (30 + 12.5 + 2))
    assert bench.device_kernel_us([]) == 0
    # an event without the newer attributes (activity_type, is_user_annotation) still counts if on the device
    from torch.autograd import DeviceType

    bare = types.SimpleNamespace(device_type=DeviceType.CUDA, time_range=types.SimpleNamespace(start=5.0, end=7.5))
    assert bench.device_kernel_us([bare]) == pytest.approx(2.5)
    assert bench.device_kernel_us([_event("cuda", 0, 9, activity="cuda_sync")]) == 0


class _FakeProfile:
    """torch.profiler.profile stand-in: counts the steps run inside it and returns their events."""

    active = None  # the session a step runs in, None outside one

    def __init__(self, activities=None, fail_on_exit=False):
        self.activities, self.steps, self.fail_on_exit = activities, 0, fail_on_exit

    def __enter__(self):
        _FakeProfile.active = self
        return self

    def __exit__(self, *exc):
        _FakeProfile.active = None
        if self.fail_on_exit:
            raise RuntimeError("kineto could not stop")
        return False

    def events(self):
        return _fake_profile_events(self.steps)


def _no_cuda(monkeypatch, profile=_FakeProfile):
    import torch.profiler

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.profiler, "profile", profile)


def test_kernel_time_ms_is_the_per_step_sum(monkeypatch):
    _no_cuda(monkeypatch)
    calls = []

    def step():
        calls.append(_FakeProfile.active)
        if _FakeProfile.active is not None:
            _FakeProfile.active.steps += 1

    ms = bench.kernel_time_ms(step, steps=7, warmup=3)
    assert ms == pytest.approx((30 + 12.5 + 2) / 1e3)  # per step, us -> ms
    assert calls[:3] == [None] * 3 and len(calls) == 10  # warm-up outside the profiler, then 7 profiled steps
    prof = calls[-1]
    assert [str(a) for a in prof.activities] == ["ProfilerActivity.CUDA"]


def test_kernel_fields_policy_and_failures(monkeypatch):
    # CPU: never profiled, whatever the option says
    monkeypatch.setattr(bench, "kernel_time_ms", lambda run: pytest.fail("profiled on the CPU"))
    for policy in ("auto", "on", "off"):
        assert bench.kernel_fields(None, policy, False, 0.1, 0.05) == {"kernel_ms": None, "frac_floor_kernels": None}
    # GPU: auto profiles up to the threshold, on always, off never
    assert bench.want_kernel_time("auto", True, bench.KERNEL_TIME_MAX_EAGER_MS)
    assert not bench.want_kernel_time("auto", True, 1.01 * bench.KERNEL_TIME_MAX_EAGER_MS)
    assert bench.want_kernel_time("on", True, 50.0) and not bench.want_kernel_time("off", True, 0.1)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(bench, "kernel_time_ms", lambda run: 0.04)
    assert bench.kernel_fields(None, "auto", True, 0.15, 0.036) == {"kernel_ms": 0.04, "frac_floor_kernels": pytest.approx(0.9)}

    def broken(run):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED\nsecond line")

    monkeypatch.setattr(bench, "kernel_time_ms", broken)
    assert bench.kernel_fields(None, "on", True, 0.15, 0.036) == {
        "kernel_ms": None, "frac_floor_kernels": None, "kernel_error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}


def test_kernel_time_ms_failures_leave_no_profiler_on(monkeypatch):
    """A step that raises inside the session, a profiler that fails to stop, a session that saw no
    kernel: each raises (kernel_fields records it) and leaves the profiler flags off."""
    import torch.autograd.profiler as autograd_profiler

    def raising_step():
        if _FakeProfile.active is not None:
            raise RuntimeError("the step failed under the profiler")

    def failing_profile(activities=None):
        autograd_profiler._is_profiler_enabled = True  # what a session that could not stop leaves behind
        return _FakeProfile(activities, fail_on_exit=True)

    for profile, step, message in [(_FakeProfile, raising_step, "the step failed"),
                                   (failing_profile, lambda: None, "kineto could not stop"),
                                   (_FakeProfile, lambda: None, "no device kernel")]:
        _no_cuda(monkeypatch, profile)
        with pytest.raises(RuntimeError, match=message):
            bench.kernel_time_ms(step, steps=2, warmup=1)
        assert not autograd_profiler._is_profiler_enabled and not torch._C._autograd._profiler_enabled()


def _kern_rows():
    base = dict(op="rms_norm", shape=dict(M=8192, D=4096), dtype="bf16", status="ok", rel_err=0.0, p20=0.14, p80=0.16,
                bytes=201334784, flops=0, floor_ms=0.0474, tbps=1.34, speedup_vs={})
    return [dict(base, mode="bwd", system="triton", ms=0.150, graph_ms=None, kernel_ms=0.0527, frac_floor=0.316,
                 frac_floor_kernels=0.9),
            dict(base, mode="fwd", system="torch", ms=0.120, graph_ms=0.070, kernel_ms=None, frac_floor=0.395,
                 frac_floor_kernels=None, kernel_error="RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"),
            dict(base, mode="fwd", system="gluon", ms=0.060, graph_ms=0.050, frac_floor=0.79),  # an old record's row
            dict(op="rms_norm", shape=dict(M=8192, D=4096), mode="bwd", system="fla", status="unavailable: no fla")]


def test_print_table_shows_the_kernel_column(capsys):
    bench.print_table(_kern_rows(), dict(bench.NOMINAL, measured=True))
    out = capsys.readouterr().out.splitlines()
    hdr = next(line for line in out if line.startswith("op "))
    assert hdr.split()[4:11] == ["ms", "p20-p80", "graph", "kern", "TB/s", "floor%", "kfl%"]
    triton, torch_row, gluon, fla = (next(line for line in out if line.startswith("rms_norm") and f" {s} " in line)
                                     for s in ("triton", "torch", "gluon", "fla"))
    assert triton.split()[4:11] == ["0.150", "0.140-0.160", "-", "0.053", "1.34", "31.6%", "90.0%"]
    assert torch_row.split()[6:8] == ["0.070", "-"] and "kern failed: RuntimeError: CUPTI" in torch_row
    assert gluon.split()[6:8] == ["0.050", "-"] and gluon.split()[10] == "-"  # no kernel_ms key: '-'
    assert "unavailable: no fla" in fla
    # every data line lines up with the header: the status column starts where "notes" does
    assert fla.index("unavailable") == hdr.index("notes")


def _results_table():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "results_table.py"
    spec = importlib.util.spec_from_file_location("results_table", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_results_table_kernel_column_only_for_records_that_have_it():
    rt = _results_table()
    rec = {"machine": {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6.0", "commit": "abc", "date": "d"},
           "ceilings": {"copy_tbps": 4.0, "matmul_tflops": 700.0}, "rows": _kern_rows()}
    lines = rt.table(rec).splitlines()
    rows = [line for line in lines if line.startswith("| rms_norm")]
    hdr = next(line for line in lines if line.startswith("| op"))
    assert "| kernel ms |" in hdr and "| % of floor (kernels) |" in hdr and "kernel ms: torch.profiler" in rt.table(rec)
    assert all(line.count("|") == hdr.count("|") for line in rows), rows
    assert "| 0.150 | - | 0.053 | 1.34 | 32% | 90% |" in rows[0]
    assert "| 0.120 | 0.070 | - | 1.34 | 40% | - |" in rows[1] and "| 0.060 | 0.050 | - |" in rows[2]
    # a record from before the column: the old table, no empty column
    old = dict(rec, rows=[{k: v for k, v in r.items() if k not in ("kernel_ms", "frac_floor_kernels", "kernel_error")}
                          for r in _kern_rows()])
    old_lines = rt.table(old).splitlines()
    old_hdr = next(line for line in old_lines if line.startswith("| op"))
    assert old_hdr == "| op | shape | mode | system | ms | graph ms | TB/s | % of floor | vs FLA (ms) |"
    assert "kernel ms" not in rt.table(old)
    assert all(line.count("|") == old_hdr.count("|") for line in old_lines if line.startswith("| rms_norm"))


def test_plot_marks_kernel_fractions(tmp_path):
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is not installed")
    out = tmp_path / "k.png"
    bench.plot(_kern_rows(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
