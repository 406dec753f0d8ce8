"""KDA's Triton backward on tests/test_kda_kept_tiles.py's case, for compute-sanitizer initcheck:
does any kernel read global memory no kernel wrote (a scratch buffer's padding, say)? Such a read
would make the gradients depend on what the allocator hands out, which is one explanation of
test_torch_compile_recomputes_and_matches_eager's rare mismatch on the H200 (dv 2.97e-6 normwise
between two runs of the same kernels on the same inputs). Run with the caching allocator off, so
that every buffer is a fresh cudaMalloc the sanitizer tracks:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck python3 scripts/initcheck_kda.py [backend ...]

Backends: triton (default), gluon. Each runs forward and backward twice: keeping the forward's
tiles (the eager default) and recomputing (KEEP_FORWARD_TILES off, the compiled path's kernels).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import test_kda_parity as parity  # noqa: E402
import torch  # noqa: E402

import tileport  # noqa: E402
from tileport.dispatch import use_backend  # noqa: E402
from tileport.ops.kda import triton_kernels as kk  # noqa: E402

torch.manual_seed(int(os.environ.get("TILEPORT_SEED", "282212568")))
B, T, H, K, V = 1, 130, 2, 64, 64
for backend in sys.argv[1:] or ["triton"]:
    for keep in (True, False):
        kk.KEEP_FORWARD_TILES = keep
        q, k, v, g, beta, _, _ = parity.make_inputs(B, T, H, K, V, torch.bfloat16, None, False, True, "mixed",
                                                    "rand", "cuda")
        for t in (q, k, v, g, beta):
            t.requires_grad_(True)
        with use_backend(backend, op="kda"):
            o, _ = tileport.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
            grads = torch.autograd.grad(o, (q, k, v, g, beta), torch.randn_like(o))
        torch.cuda.synchronize()
        print(f"{backend} keep={keep}: o {o.float().norm():.4e}, grads finite "
              f"{all(bool(x.isfinite().all()) for x in grads)}", flush=True)
