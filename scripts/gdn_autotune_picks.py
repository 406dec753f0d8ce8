"""What the autotuner picks for GDN's forward kernels on this GPU, what each candidate took, and the
whole forward in its defaults and in given switch settings.

    python3 scripts/gdn_autotune_picks.py [NAME=VALUE[,NAME=VALUE...] ...]   (on the GPU; ~1 min a form)

e.g. `python3 scripts/gdn_autotune_picks.py NORMALISED_KEYS_DIAG_PREC=tf32` times the defaults and
then the forward with that switch of `tileport.ops.gdn.triton_kernels` set. At S1 (B=8, T=4096,
H=16, K=V=128, bf16, l2-normalised q and k) and B=1 T=32768, for each form: each forward kernel's
autotune cache cleared first, so the autotuner times every candidate on these inputs; prints each
kernel's time per candidate (the autotuner's do_bench: median, p20, p80 in ms), its pick, and the
whole forward's do_bench median, with the output's normwise distance from the defaults'. Use it to
see whether a new candidate or form ever wins before keeping it.
"""

import ast
import sys

import torch
import triton.testing

from tileport.ops.gdn import triton_kernels as tk

KERNELS = ("_solve_wu_tile_kernel", "_solve_wu_kernel", "_states_kernel", "_output_kernel")


def parse(arg: str) -> dict:
    """{switch: value}: numbers and booleans as Python values (FUSED_STATES_MIN_PAIRS=32), the rest
    as strings (NORMALISED_KEYS_DIAG_PREC=tf32)."""
    out = {}
    for item in filter(None, arg.split(",")):
        name, value = item.split("=", 1)
        if not hasattr(tk, name):
            raise SystemExit(f"{name}: no such switch in tileport.ops.gdn.triton_kernels")
        try:
            out[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[name] = value
    return out


forms = [{}] + [parse(a) for a in sys.argv[1:]]
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

    base = None
    for form in forms:
        saved = {name: getattr(tk, name) for name in form}
        for name, value in form.items():
            setattr(tk, name, value)
        tag = ",".join(f"{n}={v}" for n, v in form.items()) or "defaults"
        for name in KERNELS:
            kern = getattr(tk, name)
            kern.cache.clear()
            kern.configs_timings = None
        o = forward()[0]
        torch.cuda.synchronize()
        for name in KERNELS:
            kern = getattr(tk, name)
            for cfg, t in (kern.configs_timings or {}).items():
                print(f"B={B} T={T} [{tag}] {name} {cfg}: {[round(x, 4) for x in t]}")
            for cfg in kern.cache.values():
                print(f"B={B} T={T} [{tag}] {name} picked: {cfg}")
        ms = triton.testing.do_bench(forward, warmup=25, rep=200, return_mode="median")
        base = o if base is None else base
        dist = ((o.double() - base.double()).norm() / base.double().norm()).item()
        print(f"B={B} T={T} forward (triton) [{tag}]: {ms:.3f} ms, o vs defaults {dist:.2e}", flush=True)
        for name, value in saved.items():
            setattr(tk, name, value)
