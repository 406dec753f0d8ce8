"""Per-kernel CUDA time of tileport's GDN forward and forward+backward at S1 (torch.profiler).

    python3 scripts/profile_gdn.py [triton]     (on the H200; prints one table per mode)
"""
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import tileport
from tileport.dispatch import use_backend

backend = sys.argv[1] if len(sys.argv) > 1 else "triton"
B, T, H, K, V = 8, 4096, 16, 128, 128
dev, dt = "cuda", torch.bfloat16
q = torch.randn(B, T, H, K, device=dev, dtype=dt, requires_grad=True)
k = torch.randn(B, T, H, K, device=dev, dtype=dt, requires_grad=True)
v = torch.randn(B, T, H, V, device=dev, dtype=dt, requires_grad=True)
g = F.logsigmoid(torch.randn(B, T, H, device=dev)).requires_grad_(True)
beta = torch.rand(B, T, H, device=dev).requires_grad_(True)


def fwd():
    return tileport.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]


with use_backend(backend, op="gdn"):
    for mode in ("fwd", "fwdbwd"):
        for _ in range(2):
            o = fwd()
            if mode == "fwdbwd":
                o.backward(torch.ones_like(o))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            o = fwd()
            if mode == "fwdbwd":
                o.backward(torch.ones_like(o))
            torch.cuda.synchronize()
        print(f"== {mode}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
