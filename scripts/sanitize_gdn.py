"""Small GDN calls on the Gluon kernels (both output kernels, and the fused recurrence + output on
one warpgroup and on two) for compute-sanitizer memcheck and racecheck (issue 5 asks for racecheck
clean: triton 3.6's WGMMA race, issue 11047, which needs more than 4 warps: the fused kernel's
8-warp launch).

    python3 scripts/sanitize_gdn.py [quick] [fwd] [FORM ...]     (fwd: forward only; the Gluon kernels are all there)     (FORM: one-shot, persistent, fused-BV64-4w, fused-BV128-8w, fused-BV128-8w-staged, fused-BV64-4w-ring1,
                                                       fused-BV128-8w-tma-store, fused-BV128-8w-tma-store-dqkwg,
                                                       fused-BV128-8w-tma-store-dqkwg-loop,
                                                       fused-BV128-8w-tma-store-dqkwg-loop-wy,
                                                       fused-BV128-8w-tma-store-dqkwg-loop-wy-dqk,
                                                       fused-BV128-8w-tma-store-dqkwg-loop-wy-dqk7,
                                                       fused-BV128-8w-tma-store-dqkwg-loop-wy-l2k)

A dense batch with a ragged T (a partial last chunk) and a varlen batch with a length-1 and an
empty sequence, forward and backward, K = V = 64 and 128; each OUTPUT_FORM of the gluon backend, and FORWARD_FORM "fused" at (RECURRENCE_BV, RECURRENCE_WARPS)
(64, 4) and (128, 8).
"""

import sys

import torch

import tileport
from tileport.dispatch import use_backend
from tileport.ops.gdn import gluon_kernels

torch.manual_seed(0)
quick = "quick" in sys.argv[1:]
cases = [dict(B=2, T=130, H=2, K=64, cu=None), dict(B=1, T=200, H=2, K=128, cu=[0, 1, 70, 70, 200])]
if not quick:
    cases.append(dict(B=1, T=1000, H=4, K=128, cu=None))
forms = (("one-shot", "split", 64, 4, "late"), ("persistent", "split", 64, 4, "late"),
         ("fused-BV64-4w", "fused", 64, 4, "early"), ("fused-BV128-8w", "fused", 128, 8, "early"),
         ("fused-BV128-8w-staged", "fused", 128, 8, "staged"), ("fused-BV64-4w-ring1", "fused", 64, 4, "staged"),
         ("fused-BV128-8w-tma-store", "fused", 128, 8, "staged"),
         ("fused-BV128-8w-tma-store-dqkwg", "fused", 128, 8, "staged"),  # and stage 9's state part in Gluon
         ("fused-BV128-8w-tma-store-dqkwg-loop", "fused", 128, 8, "staged"),  # ... in its key-block loop form
         ("fused-BV128-8w-tma-store-dqkwg-loop-wy", "fused", 128, 8, "staged"),  # ... and stage 10 in Gluon
         ("fused-BV128-8w-tma-store-dqkwg-loop-wy-dqk", "fused", 128, 8, "staged"),  # ... and 9a in Gluon
         ("fused-BV128-8w-tma-store-dqkwg-loop-wy-dqk7", "fused", 128, 8, "staged"),  # ... 9a with stage 7
         ("fused-BV128-8w-tma-store-dqkwg-loop-wy-l2k", "fused", 128, 8, "staged"))  # ... k's l2norm bwd in 10
forward_only = "fwd" in sys.argv[1:]
only = [a for a in sys.argv[1:] if a not in ("quick", "fwd")]
if set(only) - {f[0] for f in forms}:
    raise SystemExit(f"unknown forms {sorted(set(only) - {f[0] for f in forms})}: {[f[0] for f in forms]}")
for form, forward_form, bv, warps, gates in forms:
    if only and form not in only:
        continue
    gluon_kernels.RECURRENCE_GATES = gates
    gluon_kernels.RECURRENCE_RING = 1 if form.endswith("ring1") else 2
    gluon_kernels.RECURRENCE_O_STORE = "tma" if "tma-store" in form else "masked"
    gluon_kernels.BACKWARD_DQKWG = "gluon" if "-dqkwg" in form else "triton"
    gluon_kernels.DQKWG_STATE_FORM = "loop" if "-loop" in form else "per-block"
    gluon_kernels.BACKWARD_WY = "gluon" if "-wy" in form else "triton"
    gluon_kernels.DQK_LOCAL = "gluon" if "-dqk" in form else "triton"
    gluon_kernels.DQK_LOCAL_AT = "stage-7" if form.endswith("-dqk7") else "stage-9"
    gluon_kernels.WY_L2NORM_K = "fused" if form.endswith("-l2k") else "apart"
    gluon_kernels.OUTPUT_FORM = form if forward_form == "split" else "one-shot"
    gluon_kernels.FORWARD_FORM, gluon_kernels.RECURRENCE_BV, gluon_kernels.RECURRENCE_WARPS = forward_form, bv, warps
    for c in cases:
        B, T, H, K = c["B"], c["T"], c["H"], c["K"]
        dev, bf = "cuda", torch.bfloat16
        q, k, v = (torch.randn(B, T, H, K, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev)).requires_grad_()
        beta = torch.rand(B, T, H, device=dev, dtype=bf, requires_grad=True)
        cu = torch.tensor(c["cu"], device=dev, dtype=torch.int32) if c["cu"] else None
        with use_backend("gluon", op="gdn"):
            o, _ = tileport.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
            if not forward_only:
                o.backward(torch.randn_like(o))
        torch.cuda.synchronize()
        print(f"gluon {form} B={B} T={T} H={H} K={K} varlen={cu is not None}: ok")
