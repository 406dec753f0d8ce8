"""A/B of the rms_norm and softmax Gluon forwards on the H200, one process, same inputs: each
module's FORWARD_CTAS_PER_SM in every form (1: one program of 8 warps an SM, the default; 2: two
programs of 4 warps an SM, each with half the ring; why: the comments at the switches in
ops/rms_norm/gluon_kernels.py and ops/softmax/gluon_kernels.py), called as the forward stage
function directly and timed as a CUDA-graph replay: median (p20-p80) ms and the fraction of copy
bandwidth at 2 * M * D bytes (x read, y written; softmax's 8-byte row statistics left out).

Each output is checked against float64 with the parity gate's bound for the dtype
(`tileport.testing.check`, the relative error printed; a miss is a MISMATCH and the script exits 1
after its table), and each other form's outputs are compared bit for bit with the default's
(softmax: expected equal; rms_norm: not expected, its row sum crosses 4 warps instead of 8).

    PYTHONPATH=src python3 scripts/rows_forward_ab.py [M,D[,dtype] ...]   (default 8192,4096,bf16 4096,8192,bf16)
"""

import sys

import torch
import triton.testing

from tileport.ops.rms_norm import gluon_kernels as rms_gk
from tileport.ops.softmax import gluon_kernels as sm_gk
from tileport.testing import ParityError, check

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COPY_TBS = 4.21  # the copy ceiling measured with row 3's bench (benchmarks/results/2026-11-30-h200-llm-gluon-26c97d1.json)
EPS = 1e-6


def timed(label, module, form, fn, refs, names, dtype, floor_ms):
    """(ok, outputs) of fn with module.FORWARD_CTAS_PER_SM = form, its table line printed."""
    saved = module.FORWARD_CTAS_PER_SM
    module.FORWARD_CTAS_PER_SM = form
    try:
        got = fn()
        ms, p20, p80 = triton.testing.do_bench_cudagraph(fn, rep=200, quantiles=[0.5, 0.2, 0.8])
    finally:
        module.FORWARD_CTAS_PER_SM = saved
    errs, ok = [], True
    for name, out, ref in zip(names, got, refs):
        try:
            errs.append(f"{name} rel {check(name, out, ref, dtype):.2e}")
        except ParityError as exc:
            errs.append(f"{name} MISMATCH ({exc})")
            ok = False
    print(f"  {label:12}: {ms:.4f} ms ({p20:.4f}-{p80:.4f}), {100 * floor_ms / ms:.0f}% of copy; {', '.join(errs)}",
          flush=True)
    return ok, got


def run_forms(op, module, fn, refs, names, dtype, floor_ms):
    ok, outs = True, {}
    for form in module.FORWARD_CTAS_PER_SM_FORMS:
        passed, outs[form] = timed(f"{form} cta/SM", module, form, fn, refs, names, dtype, floor_ms)
        ok &= passed
    base = module.FORWARD_CTAS_PER_SM
    for form, got in outs.items():
        if form != base:
            same = all(torch.equal(a, b) for a, b in zip(got, outs[base]))
            print(f"    {op} {form} cta/SM bitwise equal to {base}'s: {'yes' if same else 'no'}", flush=True)
    return ok


def main() -> int:
    ok = True
    for arg in sys.argv[1:] or ["8192,4096,bf16", "4096,8192,bf16"]:
        M, D, *dt = arg.split(",")
        M, D, dtype = int(M), int(D), DT[dt[0] if dt else "bf16"]
        torch.manual_seed(0)
        floor_ms = 2 * M * D * torch.empty((), dtype=dtype).element_size() / (COPY_TBS * 1e9)
        x = torch.randn(M, D, device="cuda").to(dtype)
        w = (0.5 + torch.rand(D, device="cuda")).to(dtype)
        x64 = x.double()

        ref = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * w.double(),)
        print(f"rms_norm forward M={M} D={D} {str(dtype)[6:]} (floor {floor_ms:.4f} ms)", flush=True)
        ok &= run_forms("rms_norm", rms_gk, lambda: (rms_gk.rms_norm_forward_gluon(x, w, EPS),), ref, ("y",), dtype,
                        floor_ms)

        # y against float64; the statistics (max, 1/sum) against float64's in fp32's bound
        m64 = x64.amax(-1)
        ref = (torch.softmax(x64, -1), torch.stack([m64, 1.0 / torch.exp(x64 - m64[:, None]).sum(-1)], -1))
        print(f"softmax forward M={M} D={D} {str(dtype)[6:]} (floor {floor_ms:.4f} ms)", flush=True)
        ok &= run_forms("softmax", sm_gk, lambda: sm_gk.softmax_forward_gluon(x), ref, ("y", "stats"), dtype,
                        floor_ms)
        del x64
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
