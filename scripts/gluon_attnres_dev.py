"""GPU check of the Gluon AttnRes kernels (one call does everything; H200 with triton 3.6).

1. compiles every configuration in parallel (kernel.warmup under AsyncCompileMode);
2. checks forward and backward against the float64 reference (fresh random inputs, NaN-poisoned
   buffers) at ragged N, D in {64, 2048}, resident and streaming plans, with/without output norm;
3. times fwd and bwd at L=8, N=16384, D=2048 bf16 for a few plans (do_bench median, and CUDA graph)
   and prints TB/s against the (L+1) and (2L+1) x N x D x 2 byte floors.

Usage: PYTHONPATH=src python3 scripts/gluon_attnres_dev.py [--quick] [--no-bench] [--bench-only]
Writes a JSON summary to $OUT/gluon_attnres_dev.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch

from tileport.memory import poison_new_buffers
from tileport.ops.attnres import gluon_kernels as gk
from tileport.ops.attnres.reference import attnres_reference

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# (name, L, N, D, dtype, has_ow, fwd plan overrides, bwd plan overrides)
CORRECTNESS = [
    ("default", 8, 1, 2048, "bf16", False, {}, {}),
    ("default", 8, 37, 2048, "bf16", True, {}, {}),
    ("default", 8, 1000, 2048, "bf16", False, {}, {}),
    ("default", 8, 1000, 2048, "bf16", True, {}, {}),
    ("fwd-res/bwd-stream", 8, 1000, 2048, "bf16", False, {"resident": True, "ept": 16}, {"resident": False}),
    ("fwd-res/bwd-stream", 8, 37, 2048, "bf16", True, {"resident": True, "ept": 16}, {"resident": False}),
    ("bwd-ept32-stream", 8, 1000, 2048, "bf16", True, {}, {"resident": False, "ept": 32}),
    ("default", 3, 1, 64, "fp32", True, {}, {}),
    ("default", 3, 37, 64, "fp32", False, {}, {}),
    ("default", 3, 1000, 64, "fp32", True, {}, {}),
    ("stream", 3, 1000, 64, "fp32", True, {"resident": False}, {"resident": False}),
    ("default", 5, 1000, 64, "fp16", True, {}, {}),
    ("default", 4, 37, 2048, "fp32", True, {}, {}),
    ("default", 16, 300, 128, "bf16", False, {}, {}),
    ("default", 1, 37, 64, "bf16", True, {}, {}),
    ("fwd4w2cta", 8, 1000, 2048, "bf16", True, {"num_warps": 4, "ctas_per_sm": 2}, {}),
    ("bwd-8w1cta", 8, 37, 2048, "bf16", False, {}, {"num_warps": 8, "ctas_per_sm": 1}),
    ("bwd-2cta-stream", 8, 1000, 2048, "bf16", True, {}, {"resident": False}),
    ("default", 8, 37, 4096, "bf16", True, {}, {}),
    ("default", 8, 100, 2048, "fp32", True, {}, {}),
    ("default", 16, 300, 2048, "bf16", True, {}, {}),
    ("default", 2, 1000, 2048, "bf16", False, {}, {}),
]

SANITIZE = [
    ("san", 3, 37, 64, "bf16", True, {}, {}),
    ("san", 8, 37, 2048, "bf16", False, {}, {}),
    ("san", 8, 37, 2048, "bf16", True, {"resident": True, "ept": 16}, {"resident": False}),
]

# Measured on the H200 (call 2): fwd 8w/1cta stream 0.150 ms (graph), 4w/2cta 0.174, resident
# ept32 0.199; bwd 8w/1cta resident 0.432, 4w/2cta resident 0.404, 4w/2cta streaming 0.433.
BENCH_FWD = [
    ("fwd default", {}),
]
BENCH_BWD = [
    ("bwd default", {}),
]


def make_inputs(L, N, D, dtype, has_ow, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    # query ~ 1/sqrt(D) keeps the logits O(1): p is neither uniform nor one-hot
    query = (torch.randn(D, generator=g, device=dev) * (2.0 / math.sqrt(D))).to(dtype)
    rms_weight = (1.0 + 0.2 * torch.randn(D, generator=g, device=dev)).to(dtype)
    ow = (1.0 + 0.2 * torch.randn(D, generator=g, device=dev)).to(dtype) if has_ow else None
    residuals = tuple((torch.randn(N, D, generator=g, device=dev) * (0.5 + l % 3)).to(dtype) for l in range(L))
    dy = torch.randn(N, D, generator=g, device=dev).to(dtype)
    return query, residuals, rms_weight, ow, dy


def rel(a, b):
    a = a.double()
    b = b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


def run_case(case, eps=1e-6, scale=0.7, seed=0):
    name, L, N, D, dts, has_ow, fwd_kw, bwd_kw = case
    dtype = DT[dts]
    gk._PLAN_OVERRIDES.clear()
    gk._PLAN_OVERRIDES.update({"fwd": fwd_kw, "bwd": bwd_kw})
    query, residuals, w, ow, dy = make_inputs(L, N, D, dtype, has_ow, seed)
    with poison_new_buffers():
        # twice: the first launch of a specialisation goes through the JIT, the second through the
        # cached CompiledKernel fast path (positional arguments) - both must be right
        first = (gk.attnres_forward_gluon(query, residuals, w, ow, eps, scale, True),
                 gk.attnres_backward_gluon(dy, query, residuals, w, ow, eps, scale))
        o, p = gk.attnres_forward_gluon(query, residuals, w, ow, eps, scale, True)
        dr, dq, dw, dow = gk.attnres_backward_gluon(dy, query, residuals, w, ow, eps, scale)
    torch.cuda.synchronize()
    same = (torch.equal(first[0][0], o) and torch.equal(first[0][1], p) and torch.equal(first[1][1], dq)
            and all(torch.equal(a, b) for a, b in zip(first[1][0], dr)))
    # float64 reference and its gradients
    leaves = [query.double().requires_grad_(), w.double().requires_grad_()]
    rs = [r.double().requires_grad_() for r in residuals]
    ow64 = ow.double().requires_grad_() if ow is not None else None
    o_ref, p_ref = attnres_reference(leaves[0], rs, leaves[1], ow64, eps, scale)
    inputs = [leaves[0], leaves[1], *rs] + ([ow64] if ow64 is not None else [])
    grads = torch.autograd.grad(o_ref, inputs, dy.double())
    gq, gw, grs = grads[0], grads[1], grads[2:2 + L]
    gow = grads[2 + L] if ow64 is not None else None
    errs = {
        "o": rel(o, o_ref), "p": rel(p, p_ref),
        "dr": max(rel(a, b) for a, b in zip(dr, grs)),
        "dq": rel(dq, gq), "dw": rel(dw, gw),
    }
    if ow is not None:
        errs["dow"] = rel(dow, gow)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ok = all(math.isfinite(v) and v < tol for v in errs.values()) and same
    errs["jit==fast"] = same
    fplan = gk._plan("fwd", L, D, torch.finfo(dtype).bits // 8)
    bplan = gk._plan("bwd", L, D, torch.finfo(dtype).bits // 8)
    return ok, errs, fplan, bplan


def warm_all(cases, bench_shape):
    """Compile every configuration we are about to run, in parallel."""
    from triton.runtime._async_compile import AsyncCompileMode

    t0 = time.time()
    gk._WARMUP = True
    try:
        with AsyncCompileMode(ThreadPoolExecutor(16)):
            for case in cases:
                name, L, N, D, dts, has_ow, fwd_kw, bwd_kw = case
                gk._PLAN_OVERRIDES.clear()
                gk._PLAN_OVERRIDES.update({"fwd": fwd_kw, "bwd": bwd_kw})
                q, rs, w, ow, dy = make_inputs(L, N, D, DT[dts], has_ow, 0)
                gk.attnres_forward_gluon(q, rs, w, ow, 1e-6, 0.7, True)
                gk.attnres_backward_gluon(dy, q, rs, w, ow, 1e-6, 0.7)
            if bench_shape is not None:
                L, N, D = bench_shape
                q, rs, w, ow, dy = make_inputs(L, N, D, torch.bfloat16, True, 0)
                for has_ow in (False, True):
                    for _, kw in BENCH_FWD:
                        gk._PLAN_OVERRIDES.clear()
                        gk._PLAN_OVERRIDES["fwd"] = kw
                        gk.attnres_forward_gluon(q, rs, w, ow if has_ow else None, 1e-6, 1.0, False)
                    for _, kw in BENCH_BWD:
                        gk._PLAN_OVERRIDES.clear()
                        gk._PLAN_OVERRIDES["bwd"] = kw
                        gk.attnres_backward_gluon(dy, q, rs, w, ow if has_ow else None, 1e-6, 1.0)
    finally:
        gk._WARMUP = False
        gk._PLAN_OVERRIDES.clear()
    print(f"[warm] compiled everything in {time.time() - t0:.1f}s", flush=True)


def bench(L=8, N=16384, D=2048):
    import triton.testing as tt

    q, rs, w, ow, dy = make_inputs(L, N, D, torch.bfloat16, True, 1)
    fwd_bytes = (L + 1) * N * D * 2
    bwd_bytes = (2 * L + 1) * N * D * 2
    rows = []
    for has_ow in (False, True):
        owa = ow if has_ow else None
        for label, kw in BENCH_FWD:
            gk._PLAN_OVERRIDES.clear()
            gk._PLAN_OVERRIDES["fwd"] = kw
            plan = gk._plan("fwd", L, D, 2)
            fn = lambda: gk.attnres_forward_gluon(q, rs, w, owa, 1e-6, 1.0, False)  # noqa: E731
            rows.append(_time(tt, f"{label}{' +ow' if has_ow else ''}", plan, fn, fwd_bytes))
        for label, kw in BENCH_BWD:
            gk._PLAN_OVERRIDES.clear()
            gk._PLAN_OVERRIDES["bwd"] = kw
            plan = gk._plan("bwd", L, D, 2)
            fn = lambda: gk.attnres_backward_gluon(dy, q, rs, w, owa, 1e-6, 1.0)  # noqa: E731
            rows.append(_time(tt, f"{label}{' +ow' if has_ow else ''}", plan, fn, bwd_bytes))
    gk._PLAN_OVERRIDES.clear()
    for has_ow in (False, True):
        owa = ow if has_ow else None

        def step():
            gk.attnres_forward_gluon(q, rs, w, owa, 1e-6, 1.0, False)
            gk.attnres_backward_gluon(dy, q, rs, w, owa, 1e-6, 1.0)

        rows.append(_time(tt, f"fwd+bwd{' +ow' if has_ow else ''}", "default plans", step, fwd_bytes + bwd_bytes))
        # host time per call (no sync): must stay under the kernel time for the GPU to stay busy
        for label, fn in (("fwd", lambda: gk.attnres_forward_gluon(q, rs, w, owa, 1e-6, 1.0, False)),
                          ("bwd", lambda: gk.attnres_backward_gluon(dy, q, rs, w, owa, 1e-6, 1.0))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            host_us = (time.perf_counter() - t0) / 50 * 1e6
            torch.cuda.synchronize()
            print(f"[host] {label}{' +ow' if has_ow else ''}: {host_us:.1f} us per call (CPU side)", flush=True)
            rows.append({"label": f"host {label}{' +ow' if has_ow else ''}", "host_us": host_us})
    return rows


def _time(tt, label, plan, fn, nbytes):
    try:
        fn()
        torch.cuda.synchronize()
        ms = tt.do_bench(fn, warmup=25, rep=100, return_mode="median")
        try:
            ms_g = tt.do_bench_cudagraph(fn, rep=100, return_mode="median")
        except Exception as exc:  # noqa: BLE001
            print(f"  (cudagraph timing failed: {exc})")
            ms_g = float("nan")
        row = {"label": label, "plan": plan.describe() if not isinstance(plan, str) else plan, "ms": ms,
               "TBps": nbytes / ms / 1e9, "ms_graph": ms_g, "TBps_graph": nbytes / ms_g / 1e9}
        print(f"[bench] {label:38s} {ms:8.4f} ms {row['TBps']:5.2f} TB/s | graph {ms_g:8.4f} ms "
              f"{row['TBps_graph']:5.2f} TB/s | {row['plan']}", flush=True)
        return row
    except Exception as exc:  # noqa: BLE001
        print(f"[bench] {label}: FAILED {type(exc).__name__}: {exc}", flush=True)
        return {"label": label, "error": str(exc)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--bench-only", action="store_true")
    ap.add_argument("--sanitize", action="store_true", help="tiny cases only (run under compute-sanitizer)")
    args = ap.parse_args()
    if args.sanitize:
        bad = 0
        for case in SANITIZE:
            ok, errs, _, _ = run_case(case)
            bad += not ok
            print(f"[{'PASS' if ok else 'FAIL'}] sanitize case {case[1:6]} {errs}", flush=True)
        return 1 if bad else 0
    import triton

    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}", flush=True)
    cases = [] if args.bench_only else CORRECTNESS
    warm_all(cases, None if args.no_bench else (8, 16384, 2048))
    results = {"correctness": [], "bench": []}
    n_fail = 0
    for case in cases:
        try:
            ok, errs, fplan, bplan = run_case(case)
        except Exception as exc:  # noqa: BLE001
            ok, errs, fplan, bplan = False, {"error": f"{type(exc).__name__}: {exc}"}, "", ""
            traceback.print_exc()
        n_fail += not ok
        name, L, N, D, dts, has_ow = case[:6]
        es = " ".join(f"{k}={v:.2e}" if type(v) is float else f"{k}={v}" for k, v in errs.items())
        print(f"[{'PASS' if ok else 'FAIL'}] {name:20s} L={L:2d} N={N:5d} D={D:4d} {dts} ow={int(has_ow)} {es}",
              flush=True)
        results["correctness"].append({"case": list(case[:6]), "ok": ok, "errs": errs,
                                       "fwd_plan": getattr(fplan, "describe", lambda: str(fplan))(),
                                       "bwd_plan": getattr(bplan, "describe", lambda: str(bplan))()})
    if not args.no_bench:
        results["bench"] = bench()
    print(f"correctness: {len(cases) - n_fail}/{len(cases)} pass", flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gluon_attnres_dev.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
