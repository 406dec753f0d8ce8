"""A/B of softmax's forward kernels on the H200, one process, same inputs (docs/perf/llm_ops.md,
row 7): the Gluon forward in each form (`gluon_kernels.FORMS`: "warp_rows", the default;
"two_exchanges", row 3's kernel) and Triton's, as CUDA-graph replays (kernel time,
no host launch cost): medians (p20-p80), the fraction of copy bandwidth at 2 * M * D bytes, and
each output's largest difference from torch.softmax (y in x's dtype; the statistics' max from
x.max, their 1/sum in float64).

    PYTHONPATH=src python3 scripts/softmax_gluon_ab.py [M,D[,dtype] ...]   (default 8192,4096,bf16 8192,8192,bf16)
"""

import sys

import torch
import triton.testing

from tileport.ops.softmax import gluon_kernels as gk
from tileport.ops.softmax import triton_kernels as tk

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COPY_TBS = 4.21  # the copy ceiling measured with row 3's bench (benchmarks/results/2026-11-30-h200-llm-gluon-26c97d1.json)


def forms(x):
    for form in gk.FORMS:
        yield f"gluon {form}", form, lambda: gk.softmax_forward_gluon(x)
    yield "triton", None, lambda: tk.softmax_forward_triton(x)


args = sys.argv[1:] or ["8192,4096,bf16", "8192,8192,bf16"]
for arg in args:
    M, D, *dt = arg.split(",")
    M, D, dtype = int(M), int(D), DT[dt[0] if dt else "bf16"]
    torch.manual_seed(0)
    x = (3.0 * torch.randn(M, D, device="cuda") + torch.randn(D, device="cuda")).to(dtype)
    want = torch.softmax(x.float(), dim=-1)
    x64 = x.double()
    mx = x64.max(-1).values
    inv = 1.0 / torch.exp(x64 - mx[:, None]).sum(-1)
    floor_ms = 2 * x.numel() * x.element_size() / (COPY_TBS * 1e9)
    for label, form, fn in forms(x):
        if form is not None:
            gk.FORM = form
        y, stats = fn()  # compiles, and the outputs this form gives
        ms, p20, p80 = triton.testing.do_bench_cudagraph(fn, rep=200, quantiles=[0.5, 0.2, 0.8])
        dy = (y.float() - want).abs().max().item()
        dm = (stats[:, 0].double() - mx).abs().max().item()
        di = ((stats[:, 1].double() - inv).abs() / inv).max().item()
        print(f"M={M} D={D} {str(dtype)[6:]:8} {label:20}: {ms:.4f} ms ({p20:.4f}-{p80:.4f}), "
              f"{100 * floor_ms / ms:.0f}% of copy; max |y - torch| {dy:.3g}, stats: max {dm:.3g}, "
              f"1/sum rel {di:.3g}", flush=True)
    gk.FORM = "warp_rows"
