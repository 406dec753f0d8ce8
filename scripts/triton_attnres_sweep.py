"""GPU sweep of the AttnRes Triton backend's launch knobs (run on the H200; not for CI).

    PYTHONPATH=src python attnres_triton_sweep.py [--quick]

For each configuration: a parity check against the float64 reference at a small N, then
do_bench medians at L=8, N=16384, D=2048 bf16, reported as TB/s of the minimal traffic:
forward (L+1)*N*D*2 bytes, backward (2L+1)*N*D*2 bytes.
"""

import itertools
import sys

import torch
import triton
import triton.testing

import tileport.ops.attnres.triton_kernels as tk
from tileport.memory import poison_new_buffers
from tileport.ops.attnres.reference import attnres_reference

L, N, D, DT = 8, 16384, 2048, torch.bfloat16
dev = "cuda"
DEFAULTS = {k: getattr(tk, k) for k in ("_FWD_GATHER_ELEMS", "_BWD_GATHER_ELEMS", "_FWD_WARPS", "_BWD_WARPS",
                                         "_FWD_MAXNREG", "_BWD_MAXNREG", "_GPU_PROGRAMS", "_FWD_POLICY",
                                         "_BWD_FIRST_POLICY", "_BWD_LAST_POLICY")}


def setcfg(**kw):
    for k, v in DEFAULTS.items():
        setattr(tk, k, v)
    for k, v in kw.items():
        setattr(tk, k, v)


def inputs(n, has_ow, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    res = tuple(torch.randn(n, D, device=dev, generator=g).to(DT) for _ in range(L))
    q = torch.randn(D, device=dev, generator=g) * (2.0 / D ** 0.5)
    w = 1 + 0.3 * torch.randn(D, device=dev, generator=g)
    ow = (1 + 0.3 * torch.randn(D, device=dev, generator=g)) if has_ow else None
    dy = torch.randn(n, D, device=dev, generator=g).to(DT)
    return res, q, w, ow, dy


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return float("inf") if not torch.isfinite(x).all() else ((x - ref).norm() / ref.norm()).item()


def parity(has_ow):
    res, q, w, ow, dy = inputs(1000, has_ow, seed=1)
    with poison_new_buffers():
        o, p = tk.attnres_forward_triton(q, res, w, ow, 1e-6, 0.37, True)
        gr, gq, gw, gow = tk.attnres_backward_triton(dy, q, res, w, ow, 1e-6, 0.37)
    rr = [r.double().requires_grad_() for r in res]
    qq, ww = q.double().requires_grad_(), w.double().requires_grad_()
    oo = ow.double().requires_grad_() if has_ow else None
    ro, rp = attnres_reference(qq, rr, ww, oo, 1e-6, 0.37)
    ro.backward(dy.double())
    errs = [rel(o, ro), rel(p, rp), max(rel(a, b.grad) for a, b in zip(gr, rr)), rel(gq, qq.grad), rel(gw, ww.grad)]
    if has_ow:
        errs.append(rel(gow, oo.grad))
    return max(errs)


def bench_fwd(has_ow):
    res, q, w, ow, _ = inputs(N, has_ow)
    ms = triton.testing.do_bench(lambda: tk.attnres_forward_triton(q, res, w, ow, 1e-6, 1.0, False))
    return ms, (L + 1) * N * D * 2 / ms / 1e9


def bench_bwd(has_ow):
    res, q, w, ow, dy = inputs(N, has_ow)
    ms = triton.testing.do_bench(lambda: tk.attnres_backward_triton(dy, q, res, w, ow, 1e-6, 1.0))
    return ms, (2 * L + 1) * N * D * 2 / ms / 1e9


def describe(backward):
    cfg = tk._launch_config(N, D, L, backward)
    return f"{'gather' if cfg['GATHER'] else 'stream'} bn={cfg['BLOCK_N']} w={cfg['num_warps']} maxnreg={cfg['maxnreg']}"


quick = "--quick" in sys.argv
fwd_cfgs = [dict()]
fwd_cfgs += [dict(_FWD_WARPS=wp, _FWD_MAXNREG=mr) for wp, mr in [(4, None), (8, 80), (16, None), (16, 64)]]
fwd_cfgs += [dict(_FWD_GATHER_ELEMS=-1, _FWD_WARPS=wp) for wp in (4, 8)]
bwd_cfgs = [dict()]
bwd_cfgs += [dict(_BWD_WARPS=wp, _BWD_MAXNREG=mr, _GPU_PROGRAMS=pg)
             for wp, mr, pg in [(8, 128, 264), (16, None, 132), (16, None, 528), (8, None, 132)]]
bwd_cfgs += [dict(_BWD_GATHER_ELEMS=-1, _BWD_WARPS=wp, _BWD_MAXNREG=mr, _GPU_PROGRAMS=pg)
             for wp, mr, pg in [(8, None, 528), (8, 128, 264), (4, None, 528)]]
if quick:
    fwd_cfgs, bwd_cfgs = fwd_cfgs[:1], bwd_cfgs[:1]

print(f"AttnRes Triton, L={L} N={N} D={D} bf16, H2D-free timings (do_bench median)")
for kw, has_ow in itertools.product(fwd_cfgs, [False, True]):
    setcfg(**kw)
    err = parity(has_ow)
    ms, tbs = bench_fwd(has_ow)
    print(f"fwd ow={int(has_ow)} {describe(False):38s} {kw}  parity {err:.1e}  {ms * 1e3:7.1f} us  {tbs / 1e3:5.2f} TB/s")
for kw, has_ow in itertools.product(bwd_cfgs, [False, True]):
    setcfg(**kw)
    err = parity(has_ow)
    ms, tbs = bench_bwd(has_ow)
    print(f"bwd ow={int(has_ow)} {describe(True):38s} {kw}  parity {err:.1e}  {ms * 1e3:7.1f} us  {tbs / 1e3:5.2f} TB/s")
setcfg()
