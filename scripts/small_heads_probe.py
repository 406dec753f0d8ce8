"""GDN and KDA through the Triton backend at small and uneven head dims (K, V of 32, 16, 64/32),
forward and backward against the float64 reference, each case in its own process: a kernel that
faults (illegal address) kills only its case, where under pytest-xdist it took the worker's other
tests with it (KDA gate loop 1, 7e672c1). Prints one line per case: the relative error (normwise)
of o, dq, dk, dv, dg, dbeta, or the failure.

    python3 scripts/small_heads_probe.py                   (on the GPU; PROBE_GPUS=2 PROBE_JOBS=10 on two)
    python3 scripts/small_heads_probe.py '{"op": "kda", "K": 32, "V": 32, "l2": true, "cu": null,
                                           "min_block": 16, "whole": false}'   (one case)
    PROBE_DEV=cpu PROBE_T=70 TRITON_INTERPRET=1 ...        (one case on the CPU, a dry run)

min_block is the tile solve's TILE_MIN_BLOCK (16: the blocks before a480c47, which faulted for KDA
at K = 32), whole KDA's BACKWARD_WHOLE_CHUNKS. Keys without l2 are N(0, 1): at K >= 32, beta |k|^2
is far above 2 and the recurrence grows without bound in both backends, so those rows measure
little but that both run.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

VARLEN = [0, 1, 70, 70, 200, 330]
CASES = [dict(op=op, K=32, V=32, l2=True, cu=None, min_block=16, whole=False) for op in ("gdn", "kda")]
CASES += [dict(op=op, K=K, V=V, l2=l2, cu=cu, min_block=64, whole=False)
          for op in ("gdn", "kda") for K, V in ((32, 32), (16, 16), (64, 32)) for l2 in (True, False)
          for cu in (None, VARLEN)]
CASES += [dict(op="kda", K=K, V=K, l2=True, cu=VARLEN, min_block=64, whole=True) for K in (32, 128)]


def relative_errors(case: dict) -> list[float]:
    import torch

    import tileport
    from tileport.dispatch import use_backend
    from tileport.ops.gdn import triton_kernels as gdn_kernels
    from tileport.ops.kda import triton_kernels as kda_kernels

    gdn_kernels.TILE_MIN_BLOCK = case["min_block"]
    kda_kernels.BACKWARD_WHOLE_CHUNKS = case["whole"]
    torch.manual_seed(0)
    dev = os.environ.get("PROBE_DEV", "cuda")
    T = int(os.environ.get("PROBE_T", 330))
    B, H, K, V = (1 if case["cu"] else 2), 2, case["K"], case["V"]
    q, k = (torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
    beta = torch.sigmoid(torch.randn(B, T, H, device=dev)).to(torch.bfloat16)
    if case["op"] == "gdn":
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev))
        fn = tileport.chunk_gated_delta_rule
    else:
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=dev))
        g[:, 100:140, 0] = -25.0  # steep chunks beside whole ones
        fn = tileport.chunk_kda
    cu = None
    if case["cu"]:
        cu = torch.tensor(case["cu"] if T == VARLEN[-1] else [0, 1, T], device=dev, dtype=torch.int32)
    do = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
    results = {}
    for backend in ("triton", "reference"):
        xs = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]
        with use_backend(backend, case["op"]):
            o, _ = fn(*xs, scale=K ** -0.5, use_qk_l2norm_in_kernel=case["l2"], cu_seqlens=cu)
            grads = torch.autograd.grad(o, xs, do)
        if dev == "cuda":
            torch.cuda.synchronize()
        results[backend] = [o.double()] + [x.double() for x in grads]
    return [((a - b).norm() / b.norm().clamp_min(1e-30)).item()
            for a, b in zip(results["triton"], results["reference"])]


def run_isolated(indexed_case) -> None:
    i, case = indexed_case
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1",
               CUDA_VISIBLE_DEVICES=str(i % int(os.environ.get("PROBE_GPUS", "1"))))
    try:
        p = subprocess.run([sys.executable, __file__, json.dumps(case)], capture_output=True, text=True,
                           timeout=120, env=env)
        out = [line for line in p.stdout.splitlines() if line.startswith("ERRS")]
        if out:
            result = "ok " + " ".join(f"{e:.1e}" for e in json.loads(out[0][5:]))
        else:
            errors = [line for line in p.stderr.splitlines() if "rror" in line]
            result = f"FAIL rc={p.returncode} " + (errors[-1][:160] if errors else p.stderr[-200:])
    except subprocess.TimeoutExpired:
        result = "TIMEOUT"
    print(json.dumps(case), "->", result, flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print("ERRS", json.dumps(relative_errors(json.loads(sys.argv[1]))))
    else:
        with ThreadPoolExecutor(int(os.environ.get("PROBE_JOBS", "8"))) as pool:
            list(pool.map(run_isolated, enumerate(CASES)))
