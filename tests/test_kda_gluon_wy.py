"""KDA's stage 10 (back through W, U, T and A, with 10b's whole-chunk pair terms) on the gluon
backend's TMA + tf32 WGMMA kernel (`gluon_kernels._kda_wy_bwd_wgmma_kernel`, BACKWARD_WY "gluon",
in both its forms: WY_STAGED) for the chunks stage 3 left unflagged, Triton's kernel (CHUNKS
"flagged") for the others:
- the parity gate's accepted cases (bf16, K = V of 64 or 128), forward and backward against the
  float64 reference, with the switch on;
- stage 10 alone against Triton's on the same arguments (captured from a real backward), every
  output, in cases whose chunks take one route or both (a spy sees which kernels ran);
- the rule that picks the kernel, and (on the CPU, under the interpreter) Triton's flagged-only
  route: it writes the flagged chunks exactly as the one launch over every chunk does and leaves
  the other chunks' outputs alone.
The kernel runs on the GPU only; tests/test_gluon_compile.py compile-checks it for sm_90a.
"""

from __future__ import annotations

import pytest
import test_kda_parity as parity  # a module import: pytest would collect imported test functions
import torch
from test_kda_parity import _one_thread  # noqa: F401 (autouse fixture)
from standins import OnGPU

ACCEPTED = [cid for cid, c in parity.CASES.items() if c[5] == "bf16" and c[3] == c[4] and c[3] in (64, 128)]


def _wy_on(monkeypatch, staged: bool = False):
    """BACKWARD_WY "gluon" (in the staged form or not, WY_STAGED), and a spy on the Gluon kernel's
    launches (their grids)."""
    from tileport.ops.kda import gluon_kernels as kg

    monkeypatch.setattr(kg, "BACKWARD_WY", "gluon")
    monkeypatch.setattr(kg, "WY_STAGED", staged)
    launches = []
    real = kg._kda_wy_bwd_wgmma_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(kg, "_kda_wy_bwd_wgmma_kernel", Spy())
    return launches


# the staged form (WY_STAGED) on the cases with a varlen tail, both head dims and flagged chunks
STAGED_CASES = [c for c in ACCEPTED if c in ("varlen-bf16-l2-mixed", "K128-bf16-l2-split", "T65-bf16-l2-near0",
                                             "gpu-varlen-T1500-H4-K128-bf16-split")]


@pytest.mark.parametrize("case_id,staged", [(c, False) for c in ACCEPTED] + [(c, True) for c in STAGED_CASES])
def test_forward_backward(case_id, staged, device, seed, monkeypatch):
    parity._backend_or_skip("gluon", device)
    launches = _wy_on(monkeypatch, staged)
    parity._run_and_check("gluon", case_id, device, seed)
    assert launches, f"{case_id}: stage 10's Gluon kernel did not run"


def _stage10_args(case_id, device, backward):
    """The arguments of stage 10 (`chunk_wy_bwd_kda`'s) in one backward of the case's inputs through
    `backward` (a stage-parameterised KDA backward), with the flags of the recompute."""
    from tileport.ops.kda import triton_kernels as kk

    B, T, H, K, V, dt, cu, with_h0, l2, gates, beta_kind, scale = parity.CASES[case_id]
    q, k, v, g, beta, h0, cu_t = parity.make_inputs(B, T, H, K, V, parity.DTYPES[dt], cu, with_h0, l2, gates,
                                                    beta_kind, device)
    seen = []

    def capture(*args, **kwargs):
        # stage 9's partials (args 9 and 10) as they come in: the launch adds into the flagged chunks'
        seen.append((args[:9] + (args[9].clone(), args[10].clone()) + args[11:], kwargs))
        return kk.chunk_wy_bwd_kda(*args, **kwargs)

    do = torch.randn(B, T, H, V, device=device, dtype=q.dtype)
    backward(do, None, q, k, v, g, beta, scale or K ** -0.5, h0, l2, cu_t, wy_bwd=capture)
    assert len(seen) == 1
    return seen[0]


def _normwise(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# The Gluon kernel and Triton's form the same tf32 products of the same fp32 operands (the gate
# factors applied in fp32 the same way) but sum them in other orders: dA's four [64, 64] products
# accumulate in the WGMMA here, where Triton subtracts each from dA in turn, and dA's terms cancel;
# the pair terms carry that rounding into dk and dg. First written as 1e-5 normwise for fp32
# outputs (the bound of "the same products in another order" elsewhere in the tests); the H200
# measured dk at 1.17e-5 in T65-bf16-l2-near0 (dada13b) and the whole backward's worst gradient at
# 2.1e-5 from Triton's (kda_ab "wy", S1): 1e-4, still an order of magnitude below any term left
# out or masked wrongly. 16-bit outputs: their rounding (an element off by at most one unit in its
# last place, 2^-8 relative for bf16).
BOUND = {torch.float32: 1e-4, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _run_stage10(fn, args, kwargs, **extra):
    """fn (a stage-10 function) on the captured arguments, into NaN-filled 10b outputs and clones of
    stage 9's partials: {name: tensor} of dv, the final dk, dbeta, dg (the unflagged chunks'), dA,
    dbeta' and the partials dK', dG' as the flagged chunks leave them for 10b's launch."""
    from tileport.ops.kda import triton_kernels as kk

    outs = kk._da_apply_outputs(args[0], *(t.dtype for t in kwargs["outputs_10b"]))
    for t in outs:
        t.fill_(float("nan"))
    a = list(args)
    a[9], a[10] = args[9].clone(), args[10].clone()
    da, dbp, dv = fn(*a, **dict(kwargs, outputs_10b=outs), **extra)
    return dict(zip(("dv", "dk", "dbeta", "dg", "dA", "dbeta'", "dK'", "dG'"), (dv,) + outs + (da, dbp, a[9], a[10])))


def _chunk_rows(plan, flags):
    """[Ntok, H] bool: the tokens of the flagged chunks, per head (a chunk is its plan entry's 64
    tokens from bos, cut at its sequence's end)."""
    pairs = plan.chunks.view(-1, 2).tolist()
    Ntok = max((e for _, e in pairs), default=0)
    rows = torch.zeros(Ntok, flags.shape[1], dtype=torch.bool, device=flags.device)
    for c, (bos, eos) in enumerate(pairs):
        rows[bos:min(bos + 64, eos)] |= flags[c].bool()
    return rows


FINAL = ("dk", "dbeta", "dg")  # 10 writes them for the unflagged chunks; 10b's launch for the flagged
FOR_10B = ("dA", "dbeta'", "dK'", "dG'")  # what the flagged chunks hand to 10b's launch


@pytest.mark.parametrize("case_id,flagged", [("T65-bf16-l2-near0", False), ("T200-bf16-split-binarybeta", True),
                                             ("varlen-bf16-l2-mixed", True), ("K128-bf16-l2-split", True),
                                             ("T1-bf16", False)])
@pytest.mark.parametrize("staged", [False, True], ids=["loads", "staged"])
def test_stage10_matches_triton(case_id, flagged, staged, device, seed, monkeypatch):
    """Stage 10 on the Gluon kernel (and Triton's flagged launch) against Triton's one launch, same
    arguments: dv everywhere, the final dk, dbeta, dg of the unflagged chunks, and for the flagged
    chunks what 10b's launch reads (dA, dbeta', the partials)."""
    parity._backend_or_skip("gluon", device)
    from tileport.ops.kda import gluon_kernels as kg
    from tileport.ops.kda import triton_kernels as kk

    args, kwargs = _stage10_args(case_id, device, kk.kda_backward_triton)
    flags = kwargs["span_flags"]
    assert flags is not None and bool(flags.any()) == flagged, (case_id, flags)
    rows = _chunk_rows(kk.make_plan(*_plan_args(case_id, device)), flags)
    launches = _wy_on(monkeypatch, staged)
    ours = _run_stage10(kg.chunk_wy_bwd_kda_gluon, args, kwargs)
    assert launches, "the Gluon kernel did not run"
    theirs = _run_stage10(kk.chunk_wy_bwd_kda, args, kwargs)
    for name, a in ours.items():
        b = theirs[name]
        where = ~rows if name in FINAL else rows if name in FOR_10B else torch.ones_like(rows)
        if not where.any():
            continue
        a, b = a[where], b[where]
        assert not a.isnan().any(), f"{name}: rows left unwritten"
        err = _normwise(a, b)
        assert err <= BOUND[a.dtype], f"{name} {case_id}: normwise {err:.2e} from Triton's > {BOUND[a.dtype]:.1e}"


def _plan_args(case_id, device):
    B, T, _, _, _, _, cu, *_ = parity.CASES[case_id]
    return B, T, None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device), device


def test_flagged_route_leaves_the_other_chunks(device, seed):
    """Triton's stage 10 with only_flagged (the launch beside the Gluon kernel) writes the flagged
    chunks' dv and what 10b's launch reads exactly as the one launch over every chunk does, and
    nothing of the unflagged chunks."""
    from tileport.dispatch import interpreter_enabled
    from tileport.ops.kda import triton_kernels as kk

    if device == "cpu" and not interpreter_enabled():
        pytest.skip("the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
    case_id = "varlen-bf16-l2-mixed"
    args, kwargs = _stage10_args(case_id, device, kk.kda_backward_triton)
    flags = kwargs["span_flags"]
    assert bool(flags.any()) and not bool(flags.all()), "the case should flag some chunks and not others"
    rows = _chunk_rows(kk.make_plan(*_plan_args(case_id, device)), flags)
    whole = _run_stage10(kk.chunk_wy_bwd_kda, args, kwargs)
    dv = kk._out(args[1].shape, args[1].dtype, args[1].device).fill_(float("nan"))
    flagged_only = _run_stage10(kk.chunk_wy_bwd_kda, args, kwargs, only_flagged=True, dv=dv)
    for name in ("dv",) + FOR_10B:
        assert torch.equal(flagged_only[name][rows], whole[name][rows]), f"{name}: the flagged chunks differ"
    assert flagged_only["dv"][~rows].isnan().all(), "dv: the flagged-only launch wrote an unflagged chunk"
    for name in FINAL:
        assert flagged_only[name].isnan().all(), f"{name}: the flagged-only launch wrote a final output"
    for name in ("dK'", "dG'"):  # left as stage 9 wrote them where the chunk is not flagged
        assert torch.equal(flagged_only[name][~rows], args[9 if name == "dK'" else 10][~rows]), name


def test_rule(monkeypatch):
    """The Gluon kernel takes stage 10 with the switch on, tf32 products, fp32 operands (k any
    dtype), per-channel fp32 G, K == V of 64 or 128, the flags given and 10b fused, on the GPU."""
    from tileport.ops.kda import gluon_kernels as kg

    if kg._GLUON_ERROR is not None:
        pytest.skip(kg._GLUON_ERROR)
    f32 = OnGPU(torch.float32, 3, (64, 2, 128))
    G = OnGPU(torch.float32, 3, (64, 2, 128))
    k16 = OnGPU(torch.bfloat16, 3, (64, 2, 128))
    ops = (f32, f32) + (f32,) * 7
    flags, outs = object(), object()
    monkeypatch.setattr(kg, "BACKWARD_WY", "gluon")
    assert kg.wy_bwd_kernel_for(ops, G, torch.bfloat16, flags, outs) == "gluon"
    assert kg.wy_bwd_kernel_for((k16,) + ops[1:], G, torch.bfloat16, flags, outs) == "gluon"
    assert kg.wy_bwd_kernel_for(ops, G, torch.bfloat16, None, outs) == "triton"
    assert kg.wy_bwd_kernel_for(ops, G, torch.bfloat16, flags, None) == "triton"
    assert kg.wy_bwd_kernel_for(ops[:2] + (k16,) + ops[3:], G, torch.bfloat16, flags, outs) == "triton"
    assert kg.wy_bwd_kernel_for(ops, OnGPU(torch.float64, 3, (64, 2, 128)), torch.bfloat16, flags, outs) == "triton"
    for K, V in ((128, 64), (32, 32)):
        shaped = (OnGPU(torch.float32, 3, (64, 2, K)), OnGPU(torch.float32, 3, (64, 2, V))) + ops[2:]
        assert kg.wy_bwd_kernel_for(shaped, G, torch.bfloat16, flags, outs) == "triton", (K, V)
    monkeypatch.setattr(kg, "BACKWARD_WY", "triton")
    assert kg.wy_bwd_kernel_for(ops, G, torch.bfloat16, flags, outs) == "triton"
    monkeypatch.setattr(kg, "BACKWARD_WY", "fast")
    with pytest.raises(ValueError, match="BACKWARD_WY"):
        kg.wy_bwd_kernel_for(ops, G, torch.bfloat16, flags, outs)
