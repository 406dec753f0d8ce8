"""`tileport bench`: verify, then time every system on the same inputs, as a fraction of the floor.

For each op, shape and mode every system (our backends, FLA, torch) gets the same fresh random
inputs. A system is first checked against the float64 reference on those inputs; one that fails
is reported as FAIL and not timed, one that raises is reported as "refuses: <its message>".
Times are CUDA-event medians (triton.testing.do_bench) with p20/p80; the floor is
max(bytes / copy bandwidth, flops / matmul rate) with both ceilings measured in the same run.
On a GPU two kernel-time figures sit beside the eager median: "graph" (fwd only, CUDA-graph
replays) and "kern" (every mode, the profiler's sum of device kernel durations per step; see
kernel_time_ms), which is what tells a host-bound small op's kernels from its launch overhead.

Without a GPU it runs tiny shapes on the CPU (Triton interpreter or reference) and says that
its times mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from tileport.dispatch import BackendRefused
from tileport.testing import OUTPUT, bound, rel_error

OPS = {"attnres": "tileport.ops.attnres.perf", "gdn": "tileport.ops.gdn.perf", "kda": "tileport.ops.kda.perf", "rms_norm": "tileport.ops.rms_norm.perf", "rope": "tileport.ops.rope.perf", "swiglu": "tileport.ops.swiglu.perf", "softmax": "tileport.ops.softmax.perf", "grouped_gemm": "tileport.ops.grouped_gemm.perf"}
NOMINAL = {"copy_tbps": 4.25, "matmul_tflops": 700.0}  # SPEC.md's H200 ceilings, used on the CPU only
# The profiled kernel time ("kern"): this many steps in one profiler session, after a few untimed
# ones. Above KERNEL_TIME_MAX_EAGER_MS of eager median (GDN, KDA, the big grouped GEMMs) the host's
# 0.1-0.2 ms of Python, autograd and launches is a small share of the step and the eager time
# already says what the kernels do; --kernel-times auto skips those rows to keep the run's time
# (it already runs near the device tool's limit for the big ops).
KERNEL_TIME_STEPS = 10
KERNEL_TIME_WARMUP = 2
KERNEL_TIME_MAX_EAGER_MS = 2.0


def add_arguments(p) -> None:
    p.add_argument("--op", default="all", help="op names, comma separated, or 'all' (" + ", ".join(OPS) + ")")
    p.add_argument("--backends", default=None,
                   help="systems to run, comma separated (default: gluon,triton,fla,torch and the op's variants)")
    p.add_argument("--shapes", default=None, help="standard | anchor (SPEC's anchor shape only) | small (default: standard on a GPU, small on the CPU)")
    p.add_argument("--modes", default="fwd,bwd,fwdbwd")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--json", default=None, help="write the record here")
    p.add_argument("--plot", default=None, help="write a PNG of speedups here (needs matplotlib)")
    p.add_argument("--base", default=None, help="also run a git ref (in a worktree, subprocess) and print before/after")
    p.add_argument("--warm-workers", type=int, default=None,
                   help="GPU: compile every (op, system)'s kernels first in this many parallel processes "
                        "(default: every CPU core but one; 0: no warm-up)")
    p.add_argument("--kernel-times", default="auto", choices=["auto", "on", "off"],
                   help="GPU: also time each row's kernels with torch.profiler (the 'kern' column): "
                        f"auto (default) where the eager median is at most {KERNEL_TIME_MAX_EAGER_MS:g} ms, "
                        "on: every row, off: none")
    p.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)  # the warm-up's worker processes


# ---------------------------------------------------------------------------------------------
def compiled_system(torch, fn, args_of):
    """A torch.compile baseline: inputs -> fn(*args_of(inputs)), compiled on first use.

    It turns AOTAutograd's donated buffers off for the process (on first use): the bench's
    backward-only mode calls backward with retain_graph=True, which a graph compiled with donated
    buffers refuses, and the backward graph may be compiled lazily at that first backward."""
    state = {}

    def run(inp):
        if "fn" not in state:
            import torch._functorch.config as functorch_config

            functorch_config.donated_buffer = False
            state["fn"] = torch.compile(fn)
        return state["fn"](*args_of(inp))

    return run


def machine_info() -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        info["gpu"] = None
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                                        capture_output=True, text=True, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        info["dirty"] = bool(dirty)
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    if os.environ.get("TILEPORT_COMMIT"):
        # The device machine's copy of the tree has no .git, or a stale one (seen 2026-11-29: HEAD
        # two commits behind the tree): scripts/gpu-check passes the real commit in.
        info["commit"], info["dirty"] = os.environ["TILEPORT_COMMIT"], None
    return info


def time_ms(fn, gpu: bool) -> dict:
    """median / p20 / p80 in ms. GPU: CUDA events via do_bench. CPU: wall clock (meaningless)."""
    if gpu:
        import triton.testing

        p20, med, p80 = triton.testing.do_bench(fn, warmup=25, rep=150, quantiles=[0.2, 0.5, 0.8])
        return {"median": med, "p20": p20, "p80": p80}
    fn()
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return {"median": statistics.median(samples), "p20": samples[0], "p80": samples[-1]}


def graph_time_ms(fn) -> float | None:
    """Kernel time without host launch cost: median of CUDA-graph replays (None if fn can't be captured)."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception:  # capture can fail (host syncs, allocator); the eager time still stands
        torch.cuda.synchronize()
        return None


def device_kernel_us(events) -> float:
    """Sum of the durations (us) of the device-side events in a torch.profiler event list: kernels,
    memcpys and memsets, i.e. every event whose device_type is CUDA, except GPU user annotations.

    Those annotations (record_function ranges projected onto the GPU timeline; torch.compile's
    "CompiledFxGraph", for one) are CUDA-typed events that span the kernels they contain: counting
    them would count those kernels twice. torch's own key_averages table leaves them out of its
    device-time total for that reason (is_user_annotation). CUDA-sync events (a kineto option, off
    by default) are not work on the device either. Durations are read from each event's time_range
    (start/end, us; a FunctionEvent attribute in torch 2.13, checked here, and in older releases'
    sources), not from device_time_total, which reads 0 for an event marked async or made without
    its profiler's device (use_device). The newer attributes are read with getattr.

    Pure over its input (no profiler, no GPU): tested on the CPU with stand-in events."""
    from torch.autograd import DeviceType

    total = 0.0
    for e in events:
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue  # host events: ops, CUDA runtime calls (cudaLaunchKernel), Python
        kind = str(getattr(e, "activity_type", None) or "").lower()
        if getattr(e, "is_user_annotation", False) or "annotation" in kind or "sync" in kind:
            continue
        tr = e.time_range
        total += tr.end - tr.start
    return total


def _profiler_off() -> None:
    """Make sure no profiler session outlives a failed measurement (the next row's do_bench would
    otherwise run profiled, or its own profile() refuse to start)."""
    try:
        if torch.autograd.profiler._is_profiler_enabled or torch._C._autograd._profiler_enabled():
            torch._C._autograd._disable_profiler()
    except Exception:  # private APIs that may move between torch versions; nothing more to do
        pass
    torch.autograd.profiler._is_profiler_enabled = False


def kernel_time_ms(fn, steps: int = KERNEL_TIME_STEPS, warmup: int = KERNEL_TIME_WARMUP) -> float:
    """Device kernel time of one step of fn, in ms: fn runs `steps` times under torch.profiler
    (CUDA activity only) after `warmup` untimed calls; the sum of device kernel (and memcpy/memset)
    durations over the steps, divided by `steps` (device_kernel_us).

    A lower bound on the step's GPU time: gaps between kernels (launch latency, host stalls) are
    not in it; neither is an L2 flush between steps (as in do_bench_cudagraph's "graph", unlike
    do_bench's eager median), so an input that fits in the 50 MB L2 may read warm. Raises if the
    profiler saw no device event (no CUPTI, or fn launched nothing)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()  # every kernel ends inside the session
        us = device_kernel_us(prof.events())
    finally:
        _profiler_off()
    if not us > 0:
        raise RuntimeError("the profiler recorded no device kernel")
    return us / steps / 1e3


def want_kernel_time(policy: str, gpu: bool, eager_ms: float) -> bool:
    """Whether a row gets the profiled kernel time: never on the CPU (no CUDA activity there);
    on a GPU per --kernel-times (auto: where the eager median is at most KERNEL_TIME_MAX_EAGER_MS)."""
    if not gpu or policy == "off":
        return False
    return policy == "on" or eager_ms <= KERNEL_TIME_MAX_EAGER_MS


def kernel_fields(run, policy: str, gpu: bool, eager_ms: float, floor_ms: float) -> dict:
    """A timed row's kernel-time fields: kernel_ms and frac_floor_kernels (floor / kernel_ms), None
    where the row isn't profiled (CPU, --kernel-times, auto above the threshold) or the profiler
    failed; then also kernel_error, its message. Never raises: the row's eager time stands."""
    out = {"kernel_ms": None, "frac_floor_kernels": None}
    if not want_kernel_time(policy, gpu, eager_ms):
        return out
    try:
        kern = kernel_time_ms(run)
    except Exception as exc:
        out["kernel_error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}"
        try:
            torch.cuda.synchronize()
        except Exception:  # a sticky CUDA error shows in the next row's own timing
            pass
        return out
    return {"kernel_ms": kern, "frac_floor_kernels": floor_ms / kern}


def measure_ceilings(gpu: bool) -> dict:
    if not gpu:
        return dict(NOMINAL, measured=False)
    import triton.testing

    n = 1 << 30  # 2 GiB of bf16 each way
    x = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=50, return_mode="median")
    copy_tbps = 2 * x.numel() * 2 / (ms * 1e-3) / 1e12
    del x, y
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=10, rep=50, return_mode="median")
    mm_tflops = 2 * m**3 / (ms * 1e-3) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return {"copy_tbps": copy_tbps, "matmul_tflops": mm_tflops, "measured": True}


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.time()

    def step(self, label: str) -> None:
        self.done += 1
        width = 28
        filled = int(width * self.done / max(self.total, 1))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{time.time() - self.t0:5.0f}s {label[:48]:<48}")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _verify(out_and_grads, ref_and_grads, dtype, kinds) -> tuple[bool, float]:
    """SPEC bounds: the output and main-input gradients at OUTPUT, gate/beta gradients at GATE."""
    worst = 0.0
    for a, b, kind in zip(out_and_grads, ref_and_grads, [OUTPUT, *kinds]):
        err = rel_error(a, b)
        worst = max(worst, err)
        if not err <= bound(dtype, kind):
            return False, worst
    return True, worst


DEFAULT_SYSTEMS = ["gluon", "triton", "cutile", "fla", "torch"]


def _forcing(op: str, system: str, suite=None):
    """A context factory forcing `system` for `op` when it names one of our backends (else a no-op).
    An op's suite may define VARIANTS, {name: context factory} for our backends run a second
    way (AttnRes: Gluon with device-side descriptors); the context is entered around the forward
    and the backward alike."""
    import contextlib

    from tileport.dispatch import REGISTRY, use_backend

    variant = getattr(suite, "VARIANTS", {}).get(system)
    if variant is not None:
        return variant

    disp = REGISTRY.get(op)
    if disp is not None and system in disp._by_name:
        return lambda: use_backend(system, op=op)
    return contextlib.nullcontext


def _op_plan(op: str, args, gpu: bool):
    """The suite, device, dtype, shapes, modes, systems and system names one op runs with."""
    suite = importlib.import_module(OPS[op])
    device = "cuda" if gpu else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    kind = args.shapes or ("standard" if gpu else "small")
    shapes = {"small": suite.SMALL, "standard": suite.STANDARD, "anchor": suite.STANDARD[:1]}[kind]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.backends:
        wanted = [s.strip() for s in args.backends.split(",") if s.strip()]
    else:
        wanted = DEFAULT_SYSTEMS + list(getattr(suite, "VARIANTS", {})) + list(getattr(suite, "EXTRA_BASELINES", ()))
    return suite, device, dtype, shapes, modes, suite.systems(torch), wanted


def warm_op(op: str, args, gpu: bool) -> int:
    """Call every system of `op` once at every shape, forward and backward, untimed and unchecked:
    this compiles (and autotunes) their kernels into Triton's on-disk cache. Returns how many
    calls raised (a refusal here is reported by the timed run, not here)."""
    suite, device, dtype, shapes, modes, all_systems, wanted = _op_plan(op, args, gpu)
    failures = 0
    for shape in shapes:
        inputs = suite.make_inputs(shape, dtype, device, torch)
        leaves = suite.differentiable(inputs)
        for t in leaves:
            t.requires_grad_(True)
        for name in wanted:
            fn = all_systems.get(name)
            if fn is None:
                continue
            forced = _forcing(op, name, suite)
            want_bwd = any(m != "fwd" for m in modes) and not getattr(suite, "NO_KERNEL_BACKWARD", {}).get(name)
            try:
                with forced():
                    o = fn(inputs)
                    if want_bwd:
                        torch.autograd.grad(o, leaves, torch.randn_like(o), allow_unused=True)
            except Exception:
                failures += 1
        del inputs, leaves
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return failures


def warm_up(ops: list[str], args, workers: int) -> None:
    """Compile every op's kernels in parallel processes, one per (op, system), before the
    sequential, timed run.

    Measured on the H200 (2026-11-29, 909a64e/5031cf0): compiling and autotuning took most of a
    bench run (the first GDN system 81 s, KDA's Triton 119 s, FLA 50-80 s per op), all of it
    single-threaded in one process while 15 of 16 cores idled, and the anchor-shape run of every
    op did not fit the device tool's 600 s per call. Kernels compiled here are loaded from
    Triton's on-disk cache by the timed run; its autotuners still benchmark their configs there,
    on a quiet GPU. H200 at df3acc3: 28 pairs took 265 s on 8 processes (half the cores, the old
    default) and the whole-op bench ran past its call's limit; the slowest pairs are printed so the
    next run knows where the time goes."""
    t0 = time.time()
    cmd = [sys.executable, "-m", "tileport", "bench", "--warm-only", "--modes", args.modes, "--dtype", args.dtype]
    if args.shapes:
        cmd += ["--shapes", args.shapes]
    jobs = []
    for op in ops:
        suite, *_, systems, wanted = _op_plan(op, args, True)
        jobs += [(op, name) for name in wanted if name in systems]
    pending, running, failed, took = list(jobs), [], [], []
    print(f"compiling the kernels of {len(jobs)} (op, system) pairs first, {workers} processes at a time ...", flush=True)
    while pending or running:
        while pending and len(running) < workers:
            op, name = pending.pop(0)
            running.append((f"{op}/{name}", time.time(), subprocess.Popen(
                cmd + ["--op", op, "--backends", name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        time.sleep(0.5)
        for entry in list(running):
            job, started, proc = entry
            if proc.poll() is not None:
                running.remove(entry)
                took.append((time.time() - started, job))
                out = proc.stdout.read()
                if proc.returncode != 0:
                    failed.append(f"{job} (rc {proc.returncode}: {out.strip()[-200:]})")
    print("slowest: " + ", ".join(f"{job} {sec:.0f} s" for sec, job in sorted(took, reverse=True)[:6]), flush=True)
    note = f"; the warm-up of {', '.join(failed)} failed (the timed run compiles those itself)" if failed else ""
    print(f"compiled in {time.time() - t0:.0f} s{note}", flush=True)


def bench_op(op: str, args, gpu: bool, ceilings: dict, progress_total: list, rows_so_far=None) -> list[dict]:
    """The op's rows: every wanted system at every shape, verified against the float64 reference,
    then timed in each mode. rows_so_far(rows), where given, is called before each system with the
    op's rows until then (the caller keeps a partial record: a run cut by a time limit while one
    system runs keeps the systems before it)."""
    suite, device, dtype, shapes, modes, all_systems, wanted = _op_plan(op, args, gpu)
    rows = []
    prog = Progress(len(shapes) * len(wanted))
    for shape in shapes:
        torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
        inputs = suite.make_inputs(shape, dtype, device, torch)
        leaves = suite.differentiable(inputs)
        # The reference (float64) for the forward and the gradients, computed once per shape.
        for t in leaves:
            t.requires_grad_(True)
        ref_o = suite.reference(inputs)
        grad_o = torch.randn(ref_o.shape, device=device, dtype=dtype)
        ref_grads = torch.autograd.grad(ref_o, leaves, grad_o.double())
        ref_o = ref_o.detach()
        kinds = getattr(suite, "LEAF_KINDS", [OUTPUT] * len(leaves))
        for name in wanted:
            if rows_so_far is not None and rows:
                rows_so_far(rows)
            prog.step(f"{op} {shape} {name}")
            row = {"op": op, "shape": shape, "dtype": args.dtype, "system": name}
            fn = all_systems.get(name)
            if fn is None:
                rows.append(dict(row, status="n/a here: no such backend for this op"))
                continue
            # One of our backends is forced for the forward AND the backward: the backward dispatches
            # when autograd runs it, outside the system's own call (before this, a forced backend's
            # backward ran on the default backend: the 2026-11-29 H200 record's triton bwd rows).
            forced = _forcing(op, name, suite)
            # A system whose backward refuses (FLA's gated GDN backward on Hopper) or isn't a kernel
            # (NO_KERNEL_BACKWARD in the op's suite) still gets its forward verified and timed.
            no_bwd = getattr(suite, "NO_KERNEL_BACKWARD", {}).get(name)
            bwd_status = f"n/a here: {no_bwd}" if no_bwd else None
            want_bwd = any(m != "fwd" for m in modes) and not no_bwd
            try:
                with forced():
                    o = fn(inputs)
                grads = ()
                if want_bwd:
                    try:
                        with forced():
                            grads = torch.autograd.grad(o, leaves, grad_o, allow_unused=True)
                    except BackendRefused:
                        raise
                    except Exception as exc:
                        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                        bwd_status = f"refuses: {type(exc).__name__}: {msg[:160]}"
                if getattr(fn, "different_op", None):
                    ok, worst = True, float("nan")  # a different function, timed for scale only
                    row["note"] = fn.different_op
                else:
                    ok, worst = _verify([o, *grads], [ref_o, *ref_grads][:1 + len(grads)], dtype, kinds)
            except ImportError as exc:
                rows.append(dict(row, status=f"unavailable: {exc}"))
                continue
            except BackendRefused as exc:  # one of ours that can't run here or refuses this shape
                rows.append(dict(row, status=f"n/a here: {str(exc).split(': ', 1)[-1][:160]}"))
                continue
            except Exception as exc:  # a baseline that refuses is a result, not a crash
                msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                rows.append(dict(row, status=f"refuses: {type(exc).__name__}: {msg[:160]}"))
                continue
            if not ok:
                rows.append(dict(row, status=f"FAIL parity (worst rel {worst:.2e})"))
                continue
            del o, grads
            for mode in modes:
                if mode != "fwd" and bwd_status:
                    rows.append(dict(row, mode=mode, status=bwd_status))
                    continue
                nbytes, flops = suite.minimal_cost(shape, torch.finfo(dtype).bits // 8, mode)
                floor_ms = max(nbytes / (ceilings["copy_tbps"] * 1e12), flops / (ceilings["matmul_tflops"] * 1e12)) * 1e3
                try:
                    run = mode_step(torch, mode, fn, forced, inputs, leaves, grad_o)
                    t = time_ms(run, gpu)
                    # Graphs for the forward only: capturing an autograd backward failed for every
                    # system on the H200 and left torch's CUDA generator mid-capture, so that the
                    # next op's randn raised ("Offset increment outside graph capture").
                    t["graph"] = graph_time_ms(run) if gpu and mode == "fwd" else None
                except Exception as exc:
                    rows.append(dict(row, mode=mode, status=f"refuses: {type(exc).__name__}: {str(exc)[:160]}"))
                    continue
                # Kernel time for every mode (the backward ones have no graph), apart from the eager
                # timing: a profiler failure costs this row its "kern" figure, nothing else.
                kern = kernel_fields(run, getattr(args, "kernel_times", "auto"), gpu, t["median"], floor_ms)
                rows.append(dict(row, mode=mode, status="ok", rel_err=worst, ms=t["median"], p20=t["p20"], p80=t["p80"],
                                 graph_ms=t["graph"], kernel_ms=kern.pop("kernel_ms"),
                                 bytes=nbytes, flops=flops, floor_ms=floor_ms,
                                 tbps=nbytes / (t["median"] * 1e-3) / 1e12,
                                 frac_floor=floor_ms / t["median"], **kern))
        del inputs, leaves, ref_o, ref_grads
        if gpu:
            torch.cuda.empty_cache()
    return rows


def mode_step(torch, mode: str, fn, forced, inputs: dict, leaves: list, grad_o):
    """The callable one timed step of `mode` runs: "fwd" under no_grad; "fwdbwd" the forward and
    the gradients of grad_o; "bwd" the gradients alone, through a graph built once here and
    retained."""
    if mode == "fwd":
        def run():
            with torch.no_grad(), forced():
                fn(inputs)
    elif mode == "fwdbwd":
        def run():
            with forced():
                torch.autograd.grad(fn(inputs), leaves, grad_o, allow_unused=True)
    else:
        with forced():
            out_keep = fn(inputs)

        def run():
            with forced():
                torch.autograd.grad(out_keep, leaves, grad_o, retain_graph=True, allow_unused=True)
    return run


def add_speedups(rows: list[dict]) -> None:
    """speedup of each row against every other system on the same op/shape/mode."""
    key = lambda r: (r["op"], json.dumps(r["shape"], sort_keys=True), r.get("mode"))  # noqa: E731
    groups: dict = {}
    for r in rows:
        if r.get("status") == "ok":
            groups.setdefault(key(r), {})[r["system"]] = r["ms"]
    for r in rows:
        if r.get("status") == "ok":
            r["speedup_vs"] = {s: ms / r["ms"] for s, ms in groups[key(r)].items() if s != r["system"]}


def print_table(rows: list[dict], ceilings: dict) -> None:
    print(f"\nceilings: copy {ceilings['copy_tbps']:.2f} TB/s, bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s"
          + ("" if ceilings.get("measured") else " (SPEC nominal, not measured here)"))
    print("ms: do_bench median (CUDA events, eager launches); graph: median of CUDA-graph replays (no launch cost)")
    print(f"kern: profiled sum of device kernel durations per step (mean of {KERNEL_TIME_STEPS}; no gaps between kernels, "
          "a lower bound); kfl%: floor / kern")
    hdr = (f"{'op':<12} {'shape':<22} {'mode':<7} {'system':<13} {'ms':>8} {'p20-p80':>15} {'graph':>7} {'kern':>7} "
           f"{'TB/s':>6} {'floor%':>7} {'kfl%':>6}  notes")
    print(hdr)
    print("-" * len(hdr))
    print_rows(rows)


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        shape = ",".join(f"{k}{v}" for k, v in (r["shape"] or {}).items())
        if r.get("status") != "ok":
            print(f"{r['op']:<12} {shape:<22} {r.get('mode') or '-':<7} {r['system']:<13} {'':>8} {'':>15} {'':>7} {'':>7} "
                  f"{'':>6} {'':>7} {'':>6}  {r['status']}")
            continue
        vs = " ".join(f"x{v:.2f} vs {k}" for k, v in sorted(r.get("speedup_vs", {}).items()))
        if r.get("note"):
            vs = f"[{r['note']}] " + vs
        if r.get("kernel_error"):
            vs += f" [kern failed: {r['kernel_error'][:60]}]"
        graph = f"{r['graph_ms']:7.3f}" if r.get("graph_ms") else f"{'-':>7}"
        # rows of older records (--base, results) lack kernel_ms: '-' like a row that skipped it
        kern = f"{r['kernel_ms']:7.3f}" if r.get("kernel_ms") else f"{'-':>7}"
        kfl = f"{100 * r['frac_floor_kernels']:5.1f}%" if r.get("frac_floor_kernels") else f"{'-':>6}"
        print(f"{r['op']:<12} {shape:<22} {r['mode']:<7} {r['system']:<13} {r['ms']:8.3f} {r['p20']:7.3f}-{r['p80']:<7.3f} {graph} "
              f"{kern} {r['tbps']:6.2f} {100 * r['frac_floor']:6.1f}% {kfl}  {vs}")


BASELINE_SYSTEMS = ("fla", "torch")  # what a user would otherwise run; every other system is tileport's


def is_baseline(system: str) -> bool:
    """FLA, or anything of torch's (torch, torch_grouped_mm, torch_compile)."""
    return system in BASELINE_SYSTEMS or system.startswith("torch")


def _row_label(r: dict) -> str:
    return f"{r['op']} {','.join(str(v) for v in r['shape'].values())} {r['mode']}"


def speedups_over_baselines(rows: list[dict]) -> dict[tuple[str, str], float]:
    """{(row label, tileport system): the faster baseline's median ms / the system's} over the
    rows that ran ("ok") where at least one baseline ran too."""
    ok = [r for r in rows if r.get("status") == "ok"]
    fastest: dict[str, float] = {}
    for r in ok:
        if is_baseline(r["system"]):
            lab = _row_label(r)
            fastest[lab] = min(fastest.get(lab, float("inf")), r["ms"])
    return {(_row_label(r), r["system"]): fastest[_row_label(r)] / r["ms"]
            for r in ok if not is_baseline(r["system"]) and _row_label(r) in fastest}


def plot(rows: list[dict], path: str) -> None:
    """Two panels over every (op, shape, mode) timed: each system's fraction of the hardware floor
    (bars: eager median; a black mark: the profiled kernel time, where the row has one), and each tileport system's speedup over the faster baseline (FLA or torch) on the same inputs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    labels = sorted({_row_label(r) for r in ok})
    by = {(_row_label(r), r["system"]): r for r in ok}
    systems = sorted({r["system"] for r in ok})
    ours = [s for s in systems if not is_baseline(s)]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(6, 1.2 * len(labels)), 8), sharex=True)
    width = 0.8 / max(len(systems), 1)
    any_kern = False
    for i, s in enumerate(systems):
        vals = [100 * by[(lab, s)]["frac_floor"] if (lab, s) in by else 0 for lab in labels]
        ax.bar([j + i * width for j in range(len(labels))], vals, width, label=s, color=f"C{i}")
        # the same fraction against the profiled kernel time, where the row has one (GPU records)
        kern = [(j + i * width, 100 * by[(lab, s)]["frac_floor_kernels"]) for j, lab in enumerate(labels)
                if (lab, s) in by and by[(lab, s)].get("frac_floor_kernels")]
        if kern:
            ax.scatter(*zip(*kern), marker="_", s=120, color="k", zorder=3,
                       label="kernels only (kern)" if not any_kern else None)
            any_kern = True
    ax.set_ylabel("% of hardware floor (higher is better)\nbars: eager median; black marks: kernel time")
    ax.legend(fontsize=7)
    width2 = 0.8 / max(len(ours), 1)
    speedups = speedups_over_baselines(rows)
    for i, s in enumerate(ours):
        vals = [speedups.get((lab, s), float("nan")) for lab in labels]
        ax2.bar([j + i * width2 for j in range(len(labels))], vals, width2, label=s, color=f"C{systems.index(s)}")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_yscale("log")
    ax2.set_ylabel("speedup over the faster of FLA, torch\n(eager medians; > 1: tileport faster)")
    ax2.legend(fontsize=7)
    ax2.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax2.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_base(ref: str, args) -> dict:
    """Run the same benchmark on a git worktree of `ref` in a subprocess; return its record."""
    import tempfile

    here = os.path.dirname(os.path.abspath(__file__))
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=here, capture_output=True, text=True,
                         check=True).stdout.strip()
    sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=top, capture_output=True, text=True,
                         check=True).stdout.strip()
    tmp = tempfile.mkdtemp(prefix=f"tileport-base-{sha}-")
    wt = os.path.join(tmp, "tree")
    subprocess.run(["git", "worktree", "add", "--detach", wt, sha], cwd=top, capture_output=True, check=True)
    try:
        out_json = os.path.join(tmp, "base.json")
        cmd = [sys.executable, "-m", "tileport", "bench", "--op", args.op,
               "--modes", args.modes, "--dtype", args.dtype, "--json", out_json]
        if args.backends:
            cmd += ["--backends", args.backends]
        if args.shapes:
            cmd += ["--shapes", args.shapes]
        env = dict(os.environ, PYTHONPATH=os.path.join(wt, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        print(f"\n== base {ref} ({sha}): running in {wt}")
        proc = subprocess.run(cmd, cwd=wt, env=env, capture_output=True, text=True)
        if proc.returncode not in (0, 1) or not os.path.exists(out_json):
            raise RuntimeError(f"base run failed (rc {proc.returncode}): {proc.stderr.strip()[-400:]}")
        with open(out_json) as f:
            record = json.load(f)
        record["machine"]["commit"] = sha
        return record
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", wt], cwd=top, capture_output=True)


def compare_with_base(rows: list[dict], base_rows: list[dict], base_sha: str) -> list[dict]:
    key = lambda r: (r["op"], json.dumps(r["shape"], sort_keys=True), r.get("mode"), r["system"])  # noqa: E731
    base = {key(r): r for r in base_rows if r.get("status") == "ok"}
    out = []
    print(f"\nbefore ({base_sha}) / after (this tree), median ms:")
    print(f"{'op':<12} {'shape':<22} {'mode':<7} {'system':<13} {'before':>8} {'after':>8} {'change':>8}")
    for r in rows:
        if r.get("status") != "ok" or is_baseline(r["system"]):
            continue
        b = base.get(key(r))
        shape = ",".join(f"{k}{v}" for k, v in r["shape"].items())
        if b is None:
            print(f"{r['op']:<12} {shape:<22} {r['mode']:<7} {r['system']:<13} {'-':>8} {r['ms']:8.3f} {'new':>8}")
            continue
        change = b["ms"] / r["ms"]
        out.append({"op": r["op"], "shape": r["shape"], "mode": r["mode"], "system": r["system"],
                    "before_ms": b["ms"], "after_ms": r["ms"], "speedup": change})
        print(f"{r['op']:<12} {shape:<22} {r['mode']:<7} {r['system']:<13} {b['ms']:8.3f} {r['ms']:8.3f} {change:7.2f}x")
    return out


def run(args) -> int:
    # Under the interpreter a GPU's kernels would run on the host at full size (hours): a
    # TRITON_INTERPRET=1 run is a CPU run even on a GPU machine.
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    gpu = torch.cuda.is_available() and not interpreted
    if not gpu:
        print("=" * 78)
        print(("TRITON_INTERPRET=1" if torch.cuda.is_available() else "NO GPU")
              + ": running tiny shapes on the CPU (Triton interpreter where TRITON_INTERPRET=1,")
        print("otherwise the reference). Parity checks are real; the times mean NOTHING.")
        print("=" * 78)
    ops = list(OPS) if args.op == "all" else [o.strip() for o in args.op.split(",") if o.strip()]
    for op in ops:
        if op not in OPS:
            print(f"unknown op {op!r}; ops: {', '.join(OPS)}", file=sys.stderr)
            return 2
    if getattr(args, "warm_only", False):
        raised = sum(warm_op(op, args, gpu) for op in ops)
        print(f"warm-up of {', '.join(ops)}: done; {raised} system call(s) raised (reported by the timed run)")
        return 0
    info = machine_info()
    print(f"machine: {info.get('gpu') or 'CPU only'}  torch {info['torch']}  triton {info['triton']}  commit {info.get('commit')}")
    workers = args.warm_workers if args.warm_workers is not None else max(1, (os.cpu_count() or 2) - 1)
    if gpu and workers > 0:
        warm_up(ops, args, workers)
    ceilings = measure_ceilings(gpu)
    rows = []
    record = {"schema": 1, "machine": info, "ceilings": ceilings, "args": dict(vars(args)), "rows": rows, "gpu": gpu}
    def save_partial(op_rows: list[dict]) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(record, rows=rows + op_rows, partial=True), f, indent=1, default=str)

    for op in ops:
        try:
            op_rows = bench_op(op, args, gpu, ceilings, [], rows_so_far=save_partial)
        except Exception as exc:  # one op's crash must not lose the others' rows
            msg = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            print(f"\n{op}: bench crashed: {type(exc).__name__}: {msg}", file=sys.stderr)
            op_rows = [{"op": op, "shape": None, "system": "all", "mode": None,
                        "status": f"FAIL bench crashed: {type(exc).__name__}: {msg[:160]}"}]
            if gpu:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        # Rows and a partial record as each op ends (and before each system, save_partial): a run cut
        # short by a time limit keeps them (seen 2026-12-02: a one-op bench cut in its last system
        # after FLA's 248 s compile lost every row).
        add_speedups(op_rows)
        print_rows(op_rows)
        rows += op_rows
        save_partial([])
    print("\nfinal table:")
    print_table(rows, ceilings)
    if args.base:
        try:
            base = run_base(args.base, args)
            record["base"] = {"ref": args.base, "commit": base["machine"].get("commit"),
                              "comparison": compare_with_base(rows, base["rows"], base["machine"].get("commit"))}
        except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
            print(f"base {args.base}: could not run: {exc}")
            record["base"] = {"ref": args.base, "error": str(exc)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1, default=str)
        print(f"record: {args.json}")
    if args.plot:
        try:
            plot(rows, args.plot)
            print(f"plot: {args.plot}")
        except ImportError:
            print("plot skipped: matplotlib is not installed (pip install 'tileport[bench]')")
    failed = [r for r in rows if str(r.get("status", "")).startswith("FAIL") and r["system"] in ("gluon", "triton", "all")]
    return 1 if failed else 0
