"""A/B of the rms_norm and softmax backwards on the H200, one process, same saved inputs
(docs/perf/llm_ops.md row 9): Triton's backward (`*_backward_triton`) against the Gluon one
(`*_backward_gluon` with BACKWARD = "gluon": x and dy through the paired TMA ring, rms_norm's
weight gradient summed by `gluon_rows.sum_partial_rows`) in its default ring (16 KB tiles x 4
slots) and a deeper one (16 KB x 6), each called as the stage function directly and timed as a
CUDA-graph replay (everything it launches, no host time): median (p20-p80) ms and the fraction of
copy bandwidth at 3 * M * D bytes (x and dy read, dx written).

softmax's Gluon backward also runs in each other form of `BACKWARD_STATS` in the default ring
("gluon 16KBx4 stats-ahead": each tile's row statistics loaded a step early, the next tile's carried
in registers; "stats-in_loop": loaded at the top of their own step), its dx compared bit for bit with the default form's ("gluon 16KBx4", which, like
"gluon 16KBx6", runs the module's BACKWARD_STATS: "auto", "ahead" where a tile holds more than
one row).

rms_norm's Gluon backward also runs without the weight gradient ("gluon 16KBx4 no-dw", dx only:
no partial rows, no second kernel), to measure what dw's partial rows and their sum cost.

rms_norm's Triton backward runs in several forms: autotuned over `BWD_OPTIONS` with its weight
gradient summed by `triton_rows.sum_partial_rows` ("triton", the candidate picked printed) and by
torch's `.sum` and `.to` ("triton torch-sum", DW_SUM = "torch"), each candidate alone ("triton
c<i>", where `candidate_fits`), and the shape it had before the candidates ("triton before": one
row of 4096 a tile, 4 warps, 4 programs an SM, no pipeline, torch's sum).

Each output is checked against float64 with the parity gate's bound for the dtype
(`tileport.testing.check`, the relative error printed); a miss is reported as a MISMATCH and the
script exits 1 after its table.

    PYTHONPATH=src python3 scripts/rows_backward_ab.py [M,D[,dtype] ...]   (default 8192,4096,bf16)
"""

import contextlib
import sys

import torch
import triton.testing

from tileport import gluon_rows
from tileport.autotuning import configs
from tileport.ops.rms_norm import gluon_kernels as rms_gk
from tileport.ops.rms_norm import triton_kernels as rms_tk
from tileport.ops.softmax import gluon_kernels as sm_gk
from tileport.ops.softmax import triton_kernels as sm_tk
from tileport.testing import ParityError, check

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COPY_TBS = 4.21  # the copy ceiling measured with row 3's bench (benchmarks/results/2026-11-30-h200-llm-gluon-26c97d1.json)
RINGS = {"gluon 16KBx4": (16 * 1024, 4), "gluon 16KBx6": (16 * 1024, 6)}
EPS = 1e-6
# rms_norm's Triton backward before BWD_OPTIONS (row_config at D = 4096: one row a tile, 4 warps;
# _GPU_PROGRAMS_PER_SM 4; a plain loop), as one forced candidate, with DW_SUM = "torch"
RMS_BEFORE = dict(TILE=4096, STAGES=1, PER_SM=4, num_warps=4, num_stages=1)


@contextlib.contextmanager
def rms_triton_form(options, dw_sum):
    """rms_norm's Triton backward with `options` as its only autotune candidates (None: all of
    BWD_OPTIONS) and DW_SUM = dw_sum; the kernel's candidates and tuning cache restored after."""
    kernel = rms_tk._rms_norm_bwd_kernel
    saved = kernel.configs, kernel.cache, rms_tk.DW_SUM
    if options is not None:
        kernel.configs, kernel.cache = configs(options), {}
    rms_tk.DW_SUM = dw_sum
    try:  # what the label adds: the autotuner's pick
        yield (lambda: f" [{kernel.best_config}]") if options is None else (lambda: "")
    finally:
        kernel.configs, kernel.cache, rms_tk.DW_SUM = saved


def rms_triton_variants(D, dtype):
    """(label, form) for rms_norm's Triton backward: autotuned with either sum, each fitting
    candidate alone, and the shape before the candidates."""
    yield "triton", rms_triton_form(None, "kernel")
    yield "triton torch-sum", rms_triton_form(None, "torch")
    for i, option in enumerate(rms_tk.BWD_OPTIONS):
        if rms_tk.candidate_fits(option, D, dtype.itemsize):
            yield f"triton c{i}", rms_triton_form([option], "kernel")
    yield "triton before", rms_triton_form([RMS_BEFORE], "torch")


@contextlib.contextmanager
def softmax_stats_form(form):
    """softmax's Gluon backward with BACKWARD_STATS = form (where it loads a tile's statistics),
    restored after."""
    saved = sm_gk.BACKWARD_STATS
    sm_gk.BACKWARD_STATS = form
    try:
        yield lambda: ""
    finally:
        sm_gk.BACKWARD_STATS = saved


def variants(op_tk, op_gk, fn_name, D, dtype):
    """(label, ring or None, module whose BACKWARD to set or None, stage function, form context)."""
    triton_stage = getattr(op_tk, f"{fn_name}_triton")
    if op_tk is rms_tk:
        for label, form in rms_triton_variants(D, dtype):
            yield label, None, None, triton_stage, form
    else:
        yield "triton", None, None, triton_stage, contextlib.nullcontext(lambda: "")
    gluon_stage = getattr(op_gk, f"{fn_name}_gluon")
    for label, ring in RINGS.items():
        yield label, ring, op_gk, gluon_stage, contextlib.nullcontext(lambda: "")
    if op_gk is sm_gk:
        # the statistics' other forms in the default ring, beside its row above (same inputs)
        label, ring = next(iter(RINGS.items()))
        for form in sm_gk.BACKWARD_STATS_FORMS:
            if form != sm_gk.BACKWARD_STATS:
                yield f"{label} stats-{form}", ring, op_gk, gluon_stage, softmax_stats_form(form)


def timed(label, fn, outputs, refs, dtype, floor_ms, ring, module, form):
    saved = gluon_rows.PAIR_TILE_BYTES, gluon_rows.PAIR_STAGES
    if ring is not None:
        gluon_rows.PAIR_TILE_BYTES, gluon_rows.PAIR_STAGES = ring
    if module is not None:
        module.BACKWARD = "gluon"
    try:
        with form as picked:
            got = outputs(fn())  # compiles (and autotunes), and the outputs to check
            ms, p20, p80 = triton.testing.do_bench_cudagraph(fn, rep=200, quantiles=[0.5, 0.2, 0.8])
            label += picked()
    finally:
        gluon_rows.PAIR_TILE_BYTES, gluon_rows.PAIR_STAGES = saved
        if module is not None:
            module.BACKWARD = "triton"
    errs, ok = [], True
    for name, out, ref in zip(("dx", "dw"), got, refs):
        try:
            errs.append(f"{name} rel {check(name, out, ref, dtype):.2e}")
        except ParityError as exc:
            errs.append(f"{name} MISMATCH ({exc})")
            ok = False
    print(f"  {label:14}: {ms:.4f} ms ({p20:.4f}-{p80:.4f}), {100 * floor_ms / ms:.0f}% of copy; {', '.join(errs)}",
          flush=True)
    return ok, got


def main() -> int:
    ok = True
    for arg in sys.argv[1:] or ["8192,4096,bf16"]:
        M, D, *dt = arg.split(",")
        M, D, dtype = int(M), int(D), DT[dt[0] if dt else "bf16"]
        torch.manual_seed(0)
        floor_ms = 3 * M * D * torch.empty((), dtype=dtype).element_size() / (COPY_TBS * 1e9)
        x = torch.randn(M, D, device="cuda").to(dtype)
        dy = torch.randn(M, D, device="cuda").to(dtype)
        w = (0.5 + torch.rand(D, device="cuda")).to(dtype)

        # rms_norm: dx and dw from float64 autograd
        x64 = x.double().requires_grad_(True)
        w64 = w.double().requires_grad_(True)
        y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * w64
        refs = torch.autograd.grad(y64, (x64, w64), dy.double())
        print(f"rms_norm backward M={M} D={D} {str(dtype)[6:]} (floor {floor_ms:.4f} ms)", flush=True)
        for label, ring, module, stage, form in variants(rms_tk, rms_gk, "rms_norm_backward", D, dtype):
            ok &= timed(label, lambda stage=stage: stage(dy, x, w, EPS, True), lambda out: out, refs, dtype, floor_ms,
                        ring, module, form)[0]
        # the weight gradient's share (no switch: a measurement): the same Gluon backward without dw
        # (no partial rows, no second kernel); its dx must equal the default row's bit for bit
        label = f"{next(iter(RINGS))} no-dw"
        _, got = timed(label, lambda: rms_gk.rms_norm_backward_gluon(dy, x, w, EPS, False), lambda out: out[:1],
                       refs[:1], dtype, floor_ms, None, rms_gk, contextlib.nullcontext(lambda: ""))
        with_dw = rms_gk._rms_norm_backward_ring(dy, x, w, EPS, True)  # the Gluon kernels, dw wanted
        same = with_dw is not None and torch.equal(got[0], with_dw[0])
        print(f"    dx bitwise equal to the dw run's: {'yes' if same else 'NO'}", flush=True)
        del x64, w64, y64, refs

        # softmax: the statistics the forwards save (Triton's forward writes the layout both read)
        _, stats = sm_tk.softmax_forward_triton(x)
        x64 = x.double().requires_grad_(True)
        refs = torch.autograd.grad(torch.softmax(x64, -1), x64, dy.double())
        print(f"softmax backward M={M} D={D} {str(dtype)[6:]} (floor {floor_ms:.4f} ms)", flush=True)
        default_label = next(iter(RINGS))
        outs = {}
        for label, ring, module, stage, form in variants(sm_tk, sm_gk, "softmax_backward", D, dtype):
            passed, outs[label] = timed(label, lambda stage=stage: stage(dy, x, stats), lambda out: (out,), refs,
                                        dtype, floor_ms, ring, module, form)
            ok &= passed
            if label.startswith(f"{default_label} stats-"):
                # the statistics' forms differ in when they load, not in what they compute
                same = torch.equal(outs[label][0], outs[default_label][0])
                print(f"    dx bitwise equal to {default_label}'s: {'yes' if same else 'NO'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
