"""Per-kernel CUDA time of one op and system at the bench's first standard shape (torch.profiler).

    python3 scripts/profile_op.py <op> [system ...] [--modes fwd,fwdbwd]     (on the H200)

Same inputs and system callables as `tileport bench` (the op's perf.py suite), our backends forced
for the backward too. Every kernel is listed, torch's own included (copies, fills, reductions
around ours), which is what tells launch overhead from extra work when eager times exceed the
kernels' (AttnRes backward, 2026-11-29: 1.10 ms eager against a 0.41 ms kernel).
"""

import argparse
import importlib

import torch
from torch.profiler import ProfilerActivity, profile

from tileport.bench import OPS, _forcing

ap = argparse.ArgumentParser()
ap.add_argument("op", choices=sorted(OPS))
ap.add_argument("systems", nargs="*", default=["triton"])
ap.add_argument("--modes", default="fwd,fwdbwd")
ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
args = ap.parse_args()
suite = importlib.import_module(OPS[args.op])
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
shape = suite.STANDARD[0]
inputs = suite.make_inputs(shape, dtype, "cuda", torch)
leaves = suite.differentiable(inputs)
for t in leaves:
    t.requires_grad_(True)
all_systems = suite.systems(torch)
for name in args.systems:
    fn, forced = all_systems[name], _forcing(args.op, name, suite)
    for mode in args.modes.split(","):
        def step():
            with forced():
                o = fn(inputs)
                if mode != "fwd":
                    torch.autograd.grad(o, leaves, torch.ones_like(o), allow_unused=True)

        for _ in range(3):  # compile, autotune, warm caches
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(f"== {args.op} {shape} {name} {mode} ({args.dtype}), 5 calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
