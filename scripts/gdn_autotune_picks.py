"""What the autotuner picks for GDN's forward kernels on this GPU, and what each candidate took.

    python3 scripts/gdn_autotune_picks.py        (on the GPU; ~1 min, most of it compiling)

At S1 (B=8, T=4096, H=16, K=V=128, bf16, l2-normalised q and k) and B=1 T=32768: the forward in
its default forms, each forward kernel's autotune cache cleared first so that the autotuner times
every candidate on these inputs; prints each kernel's timings per candidate (the autotuner's own
do_bench, ms: median, p20, p80), its pick, and the whole forward's do_bench median. Use it to see
whether a new candidate (a register cap, a block shape) ever wins before keeping it.
"""

import torch
import triton.testing

from tileport.ops.gdn import triton_kernels as tk

KERNELS = ("_solve_wu_tile_kernel", "_solve_wu_kernel", "_states_kernel", "_output_kernel")
dev = "cuda"
for B, T in ((8, 4096), (1, 32768)):
    H, K, V = 16, 128, 128
    torch.manual_seed(0)
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev))
    beta = torch.sigmoid(torch.randn(B, T, H, device=dev)).to(torch.bfloat16)

    def forward():
        return tk.gdn_forward_triton(q, k, v, g, beta, K ** -0.5, None, False, True, None)

    for name in KERNELS:
        kern = getattr(tk, name)
        kern.cache.clear()
        kern.configs_timings = None
    forward()
    torch.cuda.synchronize()
    for name in KERNELS:
        kern = getattr(tk, name)
        for cfg, t in (kern.configs_timings or {}).items():
            print(f"B={B} T={T} {name} {cfg}: {[round(x, 4) for x in t]}")
        for cfg in kern.cache.values():
            print(f"B={B} T={T} {name} picked: {cfg}")
    ms = triton.testing.do_bench(forward, warmup=25, rep=200, return_mode="median")
    print(f"B={B} T={T} forward (triton, defaults): {ms:.3f} ms", flush=True)
