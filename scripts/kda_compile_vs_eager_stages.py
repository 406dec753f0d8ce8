"""Which stage of KDA's Triton backward makes test_kda_kept_tiles.py::test_torch_compile_recomputes_and_matches_eager
fail on the H200? That test's gradients differ between the eager recompute and the torch.compile
path (dv 9.30e-5 normwise at TILEPORT_SEED=1159707647, deterministic on the H200, bitwise under the
interpreter), though both run the same backward body on the same inputs. This runs the test's
calls (eager, then compiled with aot_eager, then eager again, so "first call against second" is
told apart from "eager against compiled") with every stage function of the backward recorded
(its tensor outputs copied), then lists, for each pair of runs, the stage calls whose outputs
differ (and which of their tensor inputs did). Buffers allocated empty and passed in, and rows a
kernel leaves unwritten, differ run to run without harm: read the list from the first call whose
outputs are all written (the gradients' own comparison is printed first).

    TILEPORT_SEED=1159707647 python3 scripts/kda_compile_vs_eager_stages.py     (on the GPU)
    TILEPORT_SEED=1159707647 TRITON_INTERPRET=1 python3 scripts/kda_compile_vs_eager_stages.py   (CPU dry run)
"""

import difflib
import os
import sys
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import test_kda_parity as parity  # noqa: E402
import torch  # noqa: E402

import tileport  # noqa: E402
from tileport.dispatch import use_backend  # noqa: E402
from tileport.ops.kda import triton_kernels as kk  # noqa: E402

NODE = "tests/test_kda_kept_tiles.py::test_torch_compile_recomputes_and_matches_eager"
base = int(os.environ.get("TILEPORT_SEED", "1159707647"))
torch.manual_seed((base + zlib.crc32(NODE.encode())) % (2**31))  # the test's seed (tests/conftest.py)
dev = "cuda" if torch.cuda.is_available() else "cpu"

# the stage functions `kda_backward_triton` and `kda_forward_triton` look up in kk at each call
STAGES = ["l2norm_fwd", "l2norm_bwd", "chunk_solve_wu", "chunk_states", "chunk_dv_local_kda", "chunk_dstates",
          "chunk_dqkwg_kda", "chunk_dp_apply_kda", "chunk_wy_bwd_kda", "chunk_da_apply_kda", "chunk_wu_from_t_kda"]
record: list = []


def tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in tensors(y)]
    return []


def spied(name, fn):
    def call(*args, **kwargs):
        ins = [t.detach().clone() for t in tensors(list(args) + list(kwargs.values()))]
        out = fn(*args, **kwargs)
        # in-place outputs (dq, dk, dG added to by dp_apply) are read after the call, as returned or as passed
        outs = [t.detach().clone() for t in tensors(out) + tensors(list(args))]
        record.append((name, ins, outs))
        return out
    return call


for name in STAGES:
    setattr(kk, name, spied(name, getattr(kk, name)))

B, T, H, K, V, dtype = 1, 130, 2, 64, 64, torch.bfloat16  # tests/test_kda_kept_tiles.py's CASE
q, k, v, g, beta, _, _ = parity.make_inputs(B, T, H, K, V, dtype, None, False, True, "mixed", "rand", dev)
for t in (q, k, v, g, beta):
    t.requires_grad_(True)


def f(q, k, v, g, beta):
    return tileport.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]


runs = {}
torch._dynamo.reset()
with use_backend("triton", op="kda"):
    kk.KEEP_FORWARD_TILES = False
    for label, fn in (("eager-1", f), ("compiled", torch.compile(f, fullgraph=True, backend="aot_eager")),
                      ("eager-2", f)):
        start = len(record)
        out = fn(q, k, v, g, beta)
        do = torch.manual_seed(7) and torch.randn(out.shape, device=dev, dtype=out.dtype)
        grads = torch.autograd.grad(out, (q, k, v, g, beta), do)
        runs[label] = (record[start:], [x.detach().clone() for x in grads])

for a, b in (("eager-1", "compiled"), ("eager-1", "eager-2"), ("compiled", "eager-2")):
    (rec_a, gr_a), (rec_b, gr_b) = runs[a], runs[b]
    diffs = [name for name, x, y in zip(("dq", "dk", "dv", "dg", "dbeta"), gr_a, gr_b) if not torch.equal(x, y)]
    print(f"{a} vs {b}: {len(rec_a)} / {len(rec_b)} stage calls; gradients differing: {diffs or 'none'}")
    print(f"  {a}: {' '.join(n for n, _, _ in rec_a)}")
    print(f"  {b}: {' '.join(n for n, _, _ in rec_b)}")
    # the two paths may call different stage sequences (the custom op's forward is not the autograd
    # function's): compare the calls the sequences share, matched in order by name
    matcher = difflib.SequenceMatcher(a=[n for n, _, _ in rec_a], b=[n for n, _, _ in rec_b], autojunk=False)
    any_diff = False
    for tag, i0, i1, j0, j1 in matcher.get_opcodes():
        if tag != "equal":
            print(f"  calls {i0}:{i1} of {a} ({[n for n, _, _ in rec_a[i0:i1]]}) against {j0}:{j1} of {b} "
                  f"({[n for n, _, _ in rec_b[j0:j1]]}): {tag}")
            continue
        for i, j in zip(range(i0, i1), range(j0, j1)):
            (na, ins_a, outs_a), (nb, ins_b, outs_b) = rec_a[i], rec_b[j]
            # inputs include buffers passed in to be written (torch.empty: their contents differ run to
            # run), and outputs the rows a kernel leaves unwritten (dbeta' of the chunks whose pair terms
            # another route takes): a difference in those alone is expected, so every call is listed
            diff_in = [k for k, (x, y) in enumerate(zip(ins_a, ins_b)) if x.shape != y.shape or not torch.equal(x, y)]
            bad = [k for k, (x, y) in enumerate(zip(outs_a, outs_b)) if x.shape != y.shape or not torch.equal(x, y)]
            if bad:
                any_diff = True
                errs = ", ".join(f"{k}: {((outs_a[k].double() - outs_b[k].double()).norm() / outs_b[k].double().norm().clamp_min(1e-30)).item():.2e}"
                                 for k in bad)
                print(f"  calls {i}/{j}: {na}, outputs differing (normwise) {errs}; inputs differing {diff_in or 'none'}")
    if not any_diff:
        print("  every matched stage call's outputs equal")
