"""A/B of the grouped GEMM forward's host side and epilogue on the H200, one process, same inputs
(docs/perf/llm_ops.md rows 5 to 7): the group and tile tables copied from pinned memory without a
stream sync (`memory.device_table`, the default) or from pageable memory as before (each call then
waits for the previous one's kernels), for the Gluon kernel with its TMA-store epilogue (the
default) and with the masked register store (TMA_STORE False), for the warp-specialized Gluon
kernel (WARP_SPECIALIZED True, row 8; both epilogues, pinned tables), and for Triton's kernel;
beside torch's loop of matmuls and torch._grouped_mm. Eager do_bench medians (p20, p80), and each
output's largest difference from torch's loop; an output more than two bf16 steps (at the largest
magnitude of torch's output) away from it anywhere is reported as a MISMATCH (two fp32-accumulated
products rounded to bf16 differ by a step at most; a race or a wrong tile is off by whole values),
and the script exits 1 after its table.

    python3 scripts/grouped_gemm_ab.py [G,M,K,N ...]   (on the GPU; default 8,2048,4096,4096)
"""

import math
import sys

import torch
import triton.testing

from tileport.memory import device_table as pinned_table
from tileport.ops.grouped_gemm import gluon_kernels as gg
from tileport.ops.grouped_gemm import triton_kernels as gk


def pageable_table(rows, dtype, device):
    """The tables as they were built before row 6: a pageable host-to-device copy."""
    return torch.tensor(rows, dtype=dtype).to(device)


def forms(a, b, tables):
    gluon = lambda: gg.grouped_gemm_forward_gluon(a, b)  # noqa: E731
    yield "gluon, TMA store", gluon, dict(TMA_STORE=True, WARP_SPECIALIZED=False)
    yield "gluon, masked store", gluon, dict(TMA_STORE=False, WARP_SPECIALIZED=False)
    # row 8: the warp-specialized form (its own table A/B is row 6's, so pinned tables only)
    if tables == "pinned tables":
        yield "gluon WS, TMA store", gluon, dict(TMA_STORE=True, WARP_SPECIALIZED=True)
        yield "gluon WS, masked store", gluon, dict(TMA_STORE=False, WARP_SPECIALIZED=True)
    yield "triton", lambda: gk.grouped_gemm_forward_triton(a, b), {}


shapes = [tuple(int(x) for x in arg.split(",")) for arg in sys.argv[1:]] or [(8, 2048, 4096, 4096)]
mismatches = []
for G, M, K, N in shapes:
    torch.manual_seed(0)
    a = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(G)]
    b = [torch.randn(K, N, device="cuda", dtype=torch.bfloat16) for _ in range(G)]
    want = torch.cat([x @ w for x, w in zip(a, b)])
    # two bf16 steps at the output's largest magnitude (a step at 2^e is 2^(e - 7))
    tol = 2.0 ** (math.floor(math.log2(want.float().abs().max().item())) - 6)
    flops = 2.0 * G * M * K * N
    tag = f"G={G} M={M} K={K} N={N}"

    def report(label, fn):
        ms, p20, p80 = triton.testing.do_bench(fn, warmup=25, rep=200, quantiles=[0.5, 0.2, 0.8])
        out = fn()
        out = torch.cat(out) if isinstance(out, (list, tuple)) else out
        diff = (out.float() - want.float()).abs().max().item()
        bad = not diff <= tol  # (a NaN is bad too)
        if bad:
            mismatches.append(f"{tag} {label}")
        print(f"{tag} {label:34}: {ms:.3f} ms ({p20:.3f}-{p80:.3f}), {flops / ms / 1e9:.0f} TFLOP/s, "
              f"max |diff| vs torch loop {diff:.3g}" + (f" MISMATCH (> {tol:.3g})" if bad else ""), flush=True)

    report("torch loop of matmuls", lambda: [x @ w for x, w in zip(a, b)])
    if hasattr(torch, "_grouped_mm"):  # as the bench's baseline (grouped_gemm/perf.py): operands stacked per call
        ends = torch.arange(1, G + 1, device="cuda", dtype=torch.int32) * M
        report("torch._grouped_mm", lambda: torch._grouped_mm(torch.cat(a), torch.stack(b), offs=ends))
    for tables, table_fn in (("pinned tables", pinned_table), ("pageable tables", pageable_table)):
        for name, fn, switches in forms(a, b, tables):
            saved = {k: getattr(gg, k) for k in switches}
            for k, v in switches.items():
                setattr(gg, k, v)
            gg.device_table = gk.device_table = table_fn
            report(f"{name}, {tables}", fn)
            for k, v in saved.items():
                setattr(gg, k, v)
    gg.device_table = gk.device_table = pinned_table
if mismatches:
    print("MISMATCH in: " + "; ".join(mismatches))
    sys.exit(1)
