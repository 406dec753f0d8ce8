"""Host time of an op's call, per system and mode, and where it goes (issue 8).

The H200 bench at 14963d1 timed our small Triton ops far above their kernels when launched
eagerly: rms_norm forward 0.139 ms against 0.050 in CUDA-graph replay (cuTile 0.080 / 0.075), and
forward+backward well above forward plus backward (softmax 0.701 against 0.057 + 0.175; cuTile
0.385 against 0.354). This says which part of a call costs the host what:

    python3 scripts/host_profile.py rms_norm,softmax triton,cutile,torch [--modes fwd,bwd,fwdbwd]

For each (op, system, mode), at the op's first standard shape on a GPU (its first small shape on
the CPU, where the Triton launch is the interpreter's and only the tileport lines mean anything):
  - latency: ms per call with a synchronisation after each (host and device in series);
  - host: ms per call of 30 calls issued back to back, timed on the host only (the device queue
    takes them; a host-bound call shows host close to latency);
  - a cProfile of 30 calls: own time per call grouped by where the code lives (tileport, triton,
    torch, builtins/C) and the functions that cost most;
  - on a GPU, the CUDA runtime and driver calls of 10 calls (torch.profiler): count and host time
    per call of each (launches, copies, allocations), the ones that wait for the device marked: a
    call that synchronises (a pageable host-to-device copy, cudaStreamSynchronize, a cudaMalloc or
    cudaFree) makes the next call's launches wait for this call's kernels, so the eager time becomes
    kernel time plus host time (seen with the grouped GEMM's tables, docs/perf/llm_ops.md row 6).
The modes are the bench's: fwd under no_grad, bwd alone on a retained graph, fwdbwd both.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import os
import pstats
import time

import torch

from tileport.bench import OPS, _forcing, mode_step

ap = argparse.ArgumentParser()
ap.add_argument("ops", help="comma-separated op names")
ap.add_argument("systems", nargs="?", default="triton,cutile,torch", help="comma-separated systems")
ap.add_argument("--modes", default="fwd,bwd,fwdbwd")
ap.add_argument("--calls", type=int, default=30)
args = ap.parse_args()
gpu = torch.cuda.is_available()
device = "cuda" if gpu else "cpu"


def sync():
    if gpu:
        torch.cuda.synchronize()


TILEPORT_DIR = os.path.dirname(os.path.abspath(importlib.import_module("tileport").__file__))


def where(filename: str) -> str:
    if os.path.basename(filename) in ("perf.py", "bench.py", "host_profile.py"):
        return "harness"  # the suites' system closures (torch's own calls live there), the step, this script
    if os.path.abspath(filename).startswith(TILEPORT_DIR + os.sep):
        return "tileport"
    if os.sep + "triton" + os.sep in filename:
        return "triton"
    if os.sep + "torch" + os.sep in filename:
        return "torch"
    return "builtins/C" if filename == "~" else "other"


def profile(run, n: int) -> tuple[dict, list]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        run()
    prof.disable()
    sync()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, own, cumulative, callers)
    groups: dict[str, float] = {}
    rows = []
    for (filename, line, name), (_cc, calls, own, _cum, _callers) in stats.items():
        g = where(filename)
        groups[g] = groups.get(g, 0.0) + own
        rows.append((own, g, f"{os.path.basename(filename)}:{line}({name})", calls))
    rows.sort(reverse=True)
    return {g: t / n * 1e3 for g, t in groups.items()}, [(o / n * 1e3, g, f, c / n) for o, g, f, c in rows[:8]]


# runtime and driver calls that wait for the device (or may: an allocation that misses the cache)
SYNCING = ("Synchronize", "cudaMemcpy", "cuMemcpy", "cudaMalloc", "cudaFree", "cuMemAlloc", "cuMemFree",
           "cudaHostAlloc", "cudaMemset")


def runtime_calls(run, n: int = 10) -> list[tuple[str, float, float]]:
    """(name, calls per step, host ms per step) of the CUDA runtime/driver calls of n steps, most
    time first (torch.profiler's CPU-side events named cuda* / cu*)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            run()
        sync()
    rows = [(e.key, e.count / n, e.self_cpu_time_total / n / 1e3) for e in prof.key_averages()
            if e.key.startswith(("cuda", "cu")) and e.self_cpu_time_total > 0]
    return sorted(rows, key=lambda r: -r[2])


def report(op, shape, system, mode, fn, forced, inputs, leaves, grad_o):
    run = mode_step(torch, mode, fn, forced, inputs, leaves, grad_o)
    for _ in range(3):
        run()
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        run()
        sync()
    latency = (time.perf_counter() - t0) / 10 * 1e3
    t0 = time.perf_counter()
    for _ in range(args.calls):
        run()
    host = (time.perf_counter() - t0) / args.calls * 1e3
    sync()
    groups, top = profile(run, args.calls)
    print(f"\n{op} {shape} {system} {mode}: latency {latency:.3f} ms, host {host:.3f} ms per call; "
          "profiled own time per call: " + ", ".join(f"{g} {t:.3f}" for g, t in sorted(groups.items(), key=lambda x: -x[1])))
    for own, g, f, calls in top:
        print(f"    {own:7.3f} ms  {calls:5.1f}x  {g:10} {f}")
    if gpu:
        print("  CUDA runtime/driver calls per call (host time; * may wait for the device):")
        for name, calls, ms in runtime_calls(run)[:10]:
            mark = "*" if any(x in name for x in SYNCING) else " "
            print(f"   {mark}{ms:7.3f} ms  {calls:5.1f}x  {name}")


for op in args.ops.split(","):
    suite = importlib.import_module(OPS[op])
    shape = (suite.STANDARD if gpu else suite.SMALL)[0]
    systems = suite.systems(torch)
    for system in args.systems.split(","):
        if system not in systems:
            print(f"{op} {system}: no such system for this op")
            continue
        inputs = suite.make_inputs(shape, torch.bfloat16, device, torch)
        leaves = suite.differentiable(inputs)
        for t in leaves:
            t.requires_grad_(True)
        fn, forced = systems[system], _forcing(op, system, suite)
        try:
            with forced():
                out = fn(inputs)
        except Exception as exc:  # a refusal or a missing backend is a result here
            print(f"{op} {system}: {type(exc).__name__}: {str(exc)[:150]}")
            continue
        grad_o = torch.randn_like(out)
        for mode in args.modes.split(","):
            try:
                report(op, shape, system, mode, fn, forced, inputs, leaves, grad_o)
            except Exception as exc:  # e.g. a backward the system refuses: say so, go on
                print(f"{op} {system} {mode}: {type(exc).__name__}: {str(exc)[:150]}")
        del inputs, leaves, out, grad_o
        if gpu:
            torch.cuda.empty_cache()
