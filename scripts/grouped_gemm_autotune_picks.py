"""What the autotuner picks for the Triton grouped GEMM on this GPU, and what each candidate took
(issue 8: the H200 bench at d65940e found no gain from the autotuned candidates, 1.067 ms forward
against 1.070 before, and did not say which candidate ran).

    python3 scripts/grouped_gemm_autotune_picks.py [G,M,K,N ...]   (on the GPU; default 8,2048,4096,4096)

For each shape, in bf16: the kernel's autotune cache cleared, then the forward (c = a_i b_i) and
the two backward products (da_i = dc_i b_i^T, db_i = a_i^T dc_i), each launch's candidates with
the autotuner's own timings (median, p20, p80 in ms) and its pick; then each product's do_bench
median beside torch's loop of matmuls on the same operands, and the rate as a fraction of 700
TFLOP/s.
"""

import sys

import torch
import triton.testing

from tileport.ops.grouped_gemm import triton_kernels as gk

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run under TRITON_INTERPRET=1
kernel = gk._grouped_gemm_kernel
tunings = []  # (key, {config: timings}) of each launch that tuned
run = kernel.run


def logged_run(*args, **kwargs):
    before = dict(kernel.cache)
    out = run(*args, **kwargs)
    for key, config in kernel.cache.items():
        if key not in before:
            tunings.append((key, config, dict(kernel.configs_timings or {})))
    return out


kernel.run = logged_run
shapes = [tuple(int(x) for x in a.split(",")) for a in sys.argv[1:]] or [(8, 2048, 4096, 4096)]
for G, M, K, N in shapes:
    torch.manual_seed(0)
    a = [torch.randn(M, K, device=DEV, dtype=torch.bfloat16) for _ in range(G)]
    b = [torch.randn(K, N, device=DEV, dtype=torch.bfloat16) for _ in range(G)]
    dc = torch.randn(G * M, N, device=DEV, dtype=torch.bfloat16)
    products = {
        "forward": (lambda: gk.grouped_gemm_forward_triton(a, b),
                    lambda: [x @ w for x, w in zip(a, b)]),
        "da": (lambda: gk.grouped_gemm_backward_triton(dc, a, b, True, False),
               lambda: [d @ w.t() for d, w in zip(dc.split(M), b)]),
        "db": (lambda: gk.grouped_gemm_backward_triton(dc, a, b, False, True),
               lambda: [x.t() @ d for x, d in zip(a, dc.split(M))]),
    }
    kernel.cache.clear()
    flops = 2.0 * G * M * K * N
    for name, (ours, torch_loop) in products.items():
        tunings.clear()
        ours()
        if DEV == "cuda":
            torch.cuda.synchronize()
        for key, config, timings in tunings:
            for cfg, t in timings.items():
                print(f"G={G} M={M} K={K} N={N} {name}: candidate {cfg}: {[round(x, 4) for x in t]}")
            print(f"G={G} M={M} K={K} N={N} {name}: picked {config}")
        if not tunings:
            print(f"G={G} M={M} K={K} N={N} {name}: no tuning ran (one candidate, or this key tuned before)")
        for label, fn in (("triton", ours), ("torch loop", torch_loop)):
            if DEV != "cuda":
                continue
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            print(f"G={G} M={M} K={K} N={N} {name} {label}: {ms:.3f} ms, "
                  f"{flops / ms / 1e9 / 700:.2f} of 700 TFLOP/s", flush=True)
