"""The `tileport` command: `explain` (which backend runs a call, and why not the others) and `bench`."""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
DEFAULT_SHAPES = {"attnres": "8,16384,2048", "gdn": "8,4096,16,128,128", "kda": "8,4096,16,128,128",
                  "rms_norm": "8192,4096", "rope": "8,4096,32,128", "swiglu": "8192,4096", "softmax": "8192,4096",
                  "grouped_gemm": "8,2048,4096,4096"}


def _explain(args) -> int:
    from tileport.dispatch import REGISTRY

    import tileport  # noqa: F401  (registers the ops)

    if args.op not in REGISTRY:
        print(f"unknown op {args.op!r}; ops: {', '.join(sorted(REGISTRY))}", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cap = None
    if device == "cuda":
        if args.capability:
            cap = tuple(int(x) for x in args.capability.split("."))
        elif torch.cuda.is_available():
            cap = torch.cuda.get_device_capability()
    op_module = importlib.import_module(f"tileport.ops.{args.op}")
    call = op_module.explain_call(args.shape or DEFAULT_SHAPES[args.op], DTYPES[args.dtype], device, cap)
    print(f"call: {call}")
    print(REGISTRY[args.op].explain(call, device))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tileport", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    ex = sub.add_parser("explain", help="show every backend for an op: available, accepts, why not, which runs")
    ex.add_argument("op")
    ex.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ex.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if present, else cpu")
    ex.add_argument("--shape", default=None, help="op-specific sizes, e.g. attnres: L,N,D")
    ex.add_argument("--capability", default=None, help="pretend CUDA capability, e.g. 9.0 (explain only)")

    from tileport import bench

    bench.add_arguments(sub.add_parser("bench", help="verify, then time every backend against FLA and torch"))

    from tileport import lint

    lint.add_arguments(sub.add_parser("lint", help="static check of Triton/Gluon kernels for silent pitfalls"))

    from tileport import loop

    loop.add_arguments(sub.add_parser("loop", help="porting loop: contract (start), gated attempt (try), evidence (report)"))

    args = parser.parse_args(argv)
    if args.cmd == "explain":
        return _explain(args)
    if args.cmd == "lint":
        return lint.main(args)
    if args.cmd == "loop":
        return loop.main(args)
    return bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
