"""Small AttnRes calls on the Gluon (and Triton) kernels, for compute-sanitizer memcheck/racecheck.

Covers the resident and streaming paths, with and without the output norm, forward and backward,
with a ragged token count so the tail block is exercised.
"""

import torch

import tileport
from tileport.dispatch import use_backend

torch.manual_seed(0)
import sys

args = sys.argv[1:]
quick = "quick" in args  # the two small shapes only (ragged tail; CTAs looping over blocks)
backends = [a for a in args if a != "quick"] or ["gluon", "triton"]
shapes = [(3, 37, 256), (4, 5000, 512), (8, 300, 2048), (16, 9, 4096)]
for backend in backends:
    for L, N, D in shapes[:2] if quick else shapes:
        for out_norm in (False, True):
            rs = [torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(L)]
            q = (torch.randn(D, device="cuda") / D**0.5).requires_grad_()
            w = (torch.rand(D, device="cuda") + 0.5).requires_grad_()
            ow = (torch.rand(D, device="cuda") + 0.5).requires_grad_() if out_norm else None
            with use_backend(backend, op="attnres"):
                o = tileport.fused_attnres(q, rs, w, ow)
                o.backward(torch.randn_like(o))
            torch.cuda.synchronize()
            print(f"{backend} L={L} N={N} D={D} out_norm={out_norm}: ok")
