"""One measured call of an op's system at its first standard shape, inside an NVTX range named
"measure", for Nsight Compute (issue 5 asks an ncu summary of the final kernels):

    ncu --profile-from-start off --set basic --csv --page details \\
        python3 scripts/ncu_op.py gdn triton [--mode fwd|fwdbwd] [--switch T_CHAIN=factored ...]

Warm-up calls (compiling and autotuning, which launch every candidate) run before the range, so
ncu profiles only the kernels of the measured call. `scripts/gpu-check ncu` runs it for GDN.
"""

import argparse
import ast
import importlib
import importlib.util

import torch

from tileport.bench import OPS, _forcing

ap = argparse.ArgumentParser()
ap.add_argument("op", choices=sorted(OPS))
ap.add_argument("system", nargs="?", default="triton")
ap.add_argument("--mode", default="fwd", choices=["fwd", "fwdbwd"])
ap.add_argument("--switch", action="append", default=[], metavar="NAME=VALUE",
                help="set a module-level switch of the op's triton_kernels (or gluon_kernels) first (e.g. NORMALISED_KEYS_DIAG_PREC=ieee; WU_FORM=split needs L2NORM_K_FORM=stage-1 and CUMSUM_FORM=stage-2 too); repeatable")
args = ap.parse_args()
suite = importlib.import_module(OPS[args.op])
if args.switch:  # a switch of the op's triton_kernels, or else of its gluon_kernels
    modules = [importlib.import_module(f"tileport.ops.{args.op}.{m}") for m in ("triton_kernels", "gluon_kernels")
               if importlib.util.find_spec(f"tileport.ops.{args.op}.{m}") is not None]
    for item in args.switch:
        name, _, value = item.partition("=")
        kernels = next((m for m in modules if hasattr(m, name)), None)
        if kernels is None:
            raise SystemExit(f"--switch: no module of {args.op} has {name}")
        old = getattr(kernels, name)
        setattr(kernels, name, value if isinstance(old, str) else type(old)(ast.literal_eval(value)))
        print(f"{kernels.__name__}.{name} = {getattr(kernels, name)!r} (was {old!r})")
inputs = suite.make_inputs(suite.STANDARD[0], torch.bfloat16, "cuda", torch)
leaves = suite.differentiable(inputs)
for t in leaves:
    t.requires_grad_(True)
fn, forced = suite.systems(torch)[args.system], _forcing(args.op, args.system, suite)


def step():
    with forced():
        o = fn(inputs)
        if args.mode == "fwdbwd":
            torch.autograd.grad(o, leaves, torch.ones_like(o), allow_unused=True)


for _ in range(2):
    step()
torch.cuda.synchronize()
# cudaProfilerStart/Stop mark the call for `ncu --profile-from-start off`: process-wide, so they
# take the backward's kernels, which autograd launches from its own device thread, where an NVTX
# range pushed on this thread does not reach (seen 2026-11-30: `--nvtx-include measure/` kept the
# forward's three launches of a forward+backward). The NVTX range stays for --nvtx filters.
torch.cuda.profiler.start()
torch.cuda.nvtx.range_push("measure")
step()
torch.cuda.synchronize()
torch.cuda.nvtx.range_pop()
torch.cuda.profiler.stop()
print(f"{args.op} {args.system} {args.mode}: measured call done")
