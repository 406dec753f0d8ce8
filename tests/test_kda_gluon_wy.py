"""KDA's stage 10 (back through W, U, T and A, with 10b's whole-chunk pair terms) on the gluon
backend's TMA + tf32 WGMMA kernels (BACKWARD_WY "gluon", in each of its forms, WY_FORM: the split
form's `gluon_kernels._kda_wy_dA_kernel` and `_kda_wy_pairs_kernel`, the default, or
`_kda_wy_bwd_wgmma_kernel` alone) for the chunks stage 3 left unflagged, Triton's kernel (CHUNKS
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
from kda_stage_cases import LAYOUTS, capture_stage, largest_unflagged_chunk, normwise, route_rows
from test_kda_parity import _one_thread  # noqa: F401 (autouse fixture)
from standins import LaunchSpy, OnGPU, spy_on_kernels

from tileport.testing import poisoned

ACCEPTED = [cid for cid, c in parity.CASES.items() if c[5] == "bf16" and c[3] == c[4] and c[3] in (64, 128)]


# WY_FORM: the two kernels (the default) or the one; "split-acc-keys": the two kernels with the
# pairs kernel's gated keys from its accumulator-layout tiles (PAIRS_GATED_KEYS "accumulator", off)
FORMS = ("split", "one-kernel", "split-acc-keys")


def _wy_on(monkeypatch, form: str = "split") -> list[LaunchSpy]:
    """BACKWARD_WY "gluon" in one of FORMS (with U formed for the one-kernel form), and spies on the
    launches of that form's kernels."""
    from tileport.ops.kda import gluon_kernels as kg
    from tileport.ops.kda import triton_kernels as kk

    split = form.startswith("split")
    names = ("_kda_wy_dA_kernel", "_kda_wy_pairs_kernel") if split else ("_kda_wy_bwd_wgmma_kernel",)
    monkeypatch.setattr(kg, "PAIRS_GATED_KEYS", "accumulator" if form == "split-acc-keys" else "rows")
    if not split:
        # the one kernel reads U, which the default backward no longer forms (BACKWARD_U_FROM_T:
        # `wy_bwd_kernel_for` then hands its chunks to Triton's kernel, seen on the H200 in the
        # twenty-seventh session)
        monkeypatch.setattr(kk, "BACKWARD_U_FROM_T", False)
    return spy_on_kernels(monkeypatch, kg, names, BACKWARD_WY="gluon", WY_FORM="split" if split else form)


# the one-kernel form on the cases with a varlen tail, both head dims and flagged chunks
_OTHER_FORM_NAMES = ("varlen-bf16-l2-mixed", "K128-bf16-l2-split", "T65-bf16-l2-near0", "gpu-varlen-T1500-H4-K128-bf16-split")
OTHER_FORM_CASES = [c for c in ACCEPTED if c in _OTHER_FORM_NAMES]
# the gpu- cases exist where CUDA does (test_kda_parity); the others everywhere
assert all(c in OTHER_FORM_CASES for c in _OTHER_FORM_NAMES if not c.startswith("gpu-")), \
    f"a case was renamed or left the gate: {OTHER_FORM_CASES}"


@pytest.mark.parametrize("case_id,form", [(c, "split") for c in ACCEPTED]
                         + [(c, f) for f in FORMS[1:] for c in OTHER_FORM_CASES])
def test_forward_backward(case_id, form, device, seed, monkeypatch):
    parity._backend_or_skip("gluon", device)
    spies = _wy_on(monkeypatch, form)
    parity._run_and_check("gluon", case_id, device, seed)
    assert all(spy.grids for spy in spies), f"{case_id}: stage 10's Gluon kernels ({form}) did not all run"


# The Gluon kernel and Triton's form the same tf32 products of the same fp32 operands (the gate
# factors applied in fp32 the same way) but sum them in other orders: dA's four [64, 64] products
# accumulate in the WGMMA here, where Triton subtracts each from dA in turn, and dA's terms cancel;
# the pair terms carry that rounding into dk and dg. First written as 1e-5 normwise for fp32
# outputs (the bound of "the same products in another order" elsewhere in the tests); the H200
# measured dk at 1.17e-5 in T65-bf16-l2-near0 (dada13b) and the whole backward's worst gradient at
# 2.1e-5 from Triton's (kda_ab "wy", S1): 1e-4, still two orders of magnitude below a term left
# out or a row masked wrongly in these cases. 16-bit outputs: their rounding (an element off by at
# most one unit in its last place, 2^-8 relative for bf16).
BOUND = {torch.float32: 1e-4, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
NAMES = ("dv", "dk", "dbeta", "dg", "dA", "dbeta'", "dK'", "dG'")
FINAL = ("dk", "dbeta", "dg")  # 10 writes them for the unflagged chunks; 10b's launch for the flagged
FOR_10B = ("dA", "dbeta'", "dK'", "dG'")  # what the flagged chunks hand to 10b's launch


def _run_stage10(fn, args, kwargs, **extra):
    """fn (a stage-10 function) on the captured arguments, every buffer it allocates NaN-poisoned,
    into NaN-filled 10b outputs and clones of stage 9's partials: {name: tensor} of NAMES (dv, the
    final dk, dbeta, dg of the unflagged chunks, and dA, dbeta' and the partials dK', dG' as the
    flagged chunks leave them for 10b's launch)."""
    from tileport.ops.kda import triton_kernels as kk

    outs = kk._da_apply_outputs(args[0], *(t.dtype for t in kwargs["outputs_10b"]))
    for t in outs:
        t.fill_(float("nan"))
    a = list(args)
    a[9], a[10] = args[9].clone(), args[10].clone()
    with poisoned():
        da, dbp, dv = fn(*a, **dict(kwargs, outputs_10b=outs), **extra)
    return dict(zip(NAMES, (dv,) + outs + (da, dbp, a[9], a[10])))


def _assert_route_by_route(ours, theirs, unflagged, flagged, bound, where: str, against: str) -> None:
    """Every output of NAMES written and within bound[dtype] normwise of theirs, the rows of unflagged
    and of flagged chunks apart (an error in either route cannot hide in the other's mass): dv on
    both, the final dk, dbeta, dg on the unflagged chunks, what 10b's launch reads on the flagged."""
    for name in NAMES:
        routes = (("unflagged", unflagged),) if name in FINAL else (("flagged", flagged),) if name in FOR_10B else (
            ("unflagged", unflagged), ("flagged", flagged))
        for route, rows in routes:
            a, b = ours[name][rows], theirs[name][rows]
            assert not a.isnan().any(), f"{name} on {route} chunks {where}: rows left unwritten"
            err = normwise(a, b)
            assert err <= bound[a.dtype], f"{name} on {route} chunks {where}: normwise {err:.2e} from {against}"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("l2", [False, True], ids=["raw-keys", "l2norm"])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stage10_matches_triton_route_by_route(layout, K, l2, form, device, seed, monkeypatch):
    """Stage 10 on the Gluon kernel (and Triton's flagged launch beside it) against Triton's one
    launch, same arguments (captured from a real backward), the rows of unflagged and of flagged
    chunks apart so that an error in either route cannot hide in the other's mass: dv on both,
    the final dk, dbeta, dg on the unflagged chunks (the Gluon kernel's), and on the flagged ones
    what 10b's launch reads (dA, dbeta', the partials). The cases hold whole 64-row unflagged
    chunks (the pair terms of a 1-row chunk are 0), K = 64 and 128, raw and l2-normalised keys, a
    varlen batch with an empty and a length-1 sequence; every buffer NaN-poisoned."""
    parity._backend_or_skip("gluon", device)
    from tileport.ops.kda import gluon_kernels as kg
    from tileport.ops.kda import triton_kernels as kk

    args, kwargs = capture_stage("wy_bwd", layout, K, l2, device)
    flags, plan = kwargs["span_flags"], args[11]
    assert (flags == 0).any() and (flags != 0).any(), f"the draw should flag some chunks and not others: {flags}"
    assert largest_unflagged_chunk(plan, flags) == 64, "no whole unflagged chunk: the pair terms would go untested"
    unflagged, flagged = (m.to(args[0].device) for m in route_rows(plan, flags))
    spies = _wy_on(monkeypatch, form)
    ours = _run_stage10(kg.chunk_wy_bwd_kda_gluon, args, kwargs)
    for spy in spies:
        assert spy.grids == [(plan.NC, flags.shape[1])], spy.grids
    theirs = _run_stage10(kk.chunk_wy_bwd_kda, args, kwargs)
    _assert_route_by_route(ours, theirs, unflagged, flagged, BOUND, f"[{layout} K={K} l2={l2} form={form} seed={seed}]",
                           "Triton's")


# U never formed (BACKWARD_U_FROM_T): dXu U^T as (dXu (diag(beta) V)^T) T^T, a new rounding of dA's
# U part: two tf32 products for one, and on the flagged chunks in place of a U formed at tf32x3.
# Measured under the interpreter (tf32 emulated), worst of the eight cases: dA on flagged chunks
# 4.5e-4 normwise (its terms cancel), dk, dg, dbeta 4.3e-5, dv and the partials bitwise. 2e-3 for
# fp32 outputs, unmeasured on the H200; T in place of T^T puts dA off by O(1).
U_FREE_BOUND = {torch.float32: 2e-3, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


@pytest.mark.parametrize("l2", [False, True], ids=["raw-keys", "l2norm"])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stage10_without_u_route_by_route(layout, K, l2, device, seed, monkeypatch):
    """Stage 10 with U never formed (u None: the U_FREE kernels; on the GPU the Gluon dA kernel for
    the unflagged chunks, which a spy sees run, and Triton's for the flagged; on the CPU Triton's
    for all) against Triton's one launch from U, same arguments, route by route: dv, the final dk,
    dbeta, dg of the unflagged chunks, and dA, dbeta' and the partials the flagged chunks hand to
    10b; K = 64 (one block of channels) and 128 (two: dAu summed over blocks, U_b's slot reused)."""
    from tileport.dispatch import interpreter_enabled
    from tileport.ops.kda import gluon_kernels as kg
    from tileport.ops.kda import triton_kernels as kk

    if device == "cpu" and not interpreter_enabled():
        pytest.skip("the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
    args, kwargs = capture_stage("wy_bwd", layout, K, l2, device)
    flags, plan = kwargs["span_flags"], args[11]
    assert (flags == 0).any() and (flags != 0).any(), f"the draw should flag some chunks and not others: {flags}"
    unflagged, flagged = (m.to(args[0].device) for m in route_rows(plan, flags))
    no_u = args[:6] + (None,) + args[7:]
    if device == "cuda":
        spies = _wy_on(monkeypatch, "split")
        ours = _run_stage10(kg.chunk_wy_bwd_kda_gluon, no_u, kwargs)
        assert all(spy.grids == [(plan.NC, flags.shape[1])] for spy in spies), [spy.grids for spy in spies]
    else:
        ours = _run_stage10(kk.chunk_wy_bwd_kda, no_u, kwargs)
    theirs = _run_stage10(kk.chunk_wy_bwd_kda, args, kwargs)
    _assert_route_by_route(ours, theirs, unflagged, flagged, U_FREE_BOUND, f"[{layout} K={K} l2={l2} seed={seed}]",
                           "U's")


# stage 10's arguments that may come in bf16: W (5, BACKWARD_W_DTYPE) and dVn (8, BACKWARD_DSTATES_DTYPE)
WIDENED = {"dvn": (8,), "w": (5,), "w-dvn": (5, 8)}


@pytest.mark.parametrize("which", list(WIDENED))
@pytest.mark.parametrize("u_formed", [False, True], ids=["u-free", "u-formed"])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stage10_widens_bf16_dvn(layout, K, u_formed, which, device, seed, monkeypatch):
    """Stage 8's dVn in bf16 (triton_kernels.BACKWARD_DSTATES_DTYPE "bf16") and the backward's W in
    bf16 (BACKWARD_W_DTYPE "bf16"), alone and together: stage 10 given them computes bitwise what it
    computes from fp32 tensors holding the same values (every kernel widens them where it reads them),
    route by route: on the GPU the Gluon split form (the dA kernel in both of its tile forms,
    DA_TILES) with Triton's flagged launch, which spies see run; on the CPU Triton's kernel for every
    chunk. U never formed (the default) or formed."""
    from tileport.dispatch import interpreter_enabled
    from tileport.ops.kda import gluon_kernels as kg
    from tileport.ops.kda import triton_kernels as kk

    if device == "cpu" and not interpreter_enabled():
        pytest.skip("the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
    args, kwargs = capture_stage("wy_bwd", layout, K, True, device)
    flags, plan = kwargs["span_flags"], args[11]
    if not u_formed:
        args = args[:6] + (None,) + args[7:]
    given = tuple(x.to(torch.bfloat16) if i in WIDENED[which] else x for i, x in enumerate(args))
    for i in WIDENED[which]:
        assert not torch.equal(given[i].float(), args[i]), f"argument {i}: the draw's values are bf16 ones already"
    widened = tuple(x.float() if i in WIDENED[which] else x for i, x in enumerate(given))
    tile_forms = ("loads", "tma") if device == "cuda" else ("loads",)
    spies = _wy_on(monkeypatch, "split") if device == "cuda" else []
    fn = kg.chunk_wy_bwd_kda_gluon if device == "cuda" else kk.chunk_wy_bwd_kda
    for n, tiles in enumerate(tile_forms, 1):
        monkeypatch.setattr(kg, "DA_TILES", tiles)
        ours = _run_stage10(fn, given, kwargs)
        theirs = _run_stage10(fn, widened, kwargs)
        assert all(spy.grids == [(plan.NC, flags.shape[1])] * 2 * n for spy in spies), [spy.grids for spy in spies]
        for name in NAMES:
            assert torch.equal(ours[name].nan_to_num(7.0), theirs[name].nan_to_num(7.0)), \
                f"{name} [{layout} K={K} u_formed={u_formed} {tiles} {which}]: bf16 != the same values in fp32"


def test_flagged_route_leaves_the_other_chunks(device, seed):
    """Triton's stage 10 with only_flagged (the launch beside the Gluon kernel) writes the flagged
    chunks' dv and what 10b's launch reads exactly as the one launch over every chunk does, and
    nothing of the unflagged chunks."""
    from tileport.dispatch import interpreter_enabled
    from tileport.ops.kda import triton_kernels as kk

    if device == "cpu" and not interpreter_enabled():
        pytest.skip("the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
    args, kwargs = capture_stage("wy_bwd", "varlen-empty-len1", 64, True, device)
    flags, plan = kwargs["span_flags"], args[11]
    assert bool(flags.any()) and not bool(flags.all()), "the case should flag some chunks and not others"
    rows = route_rows(plan, flags)[1].to(args[0].device)
    whole = _run_stage10(kk.chunk_wy_bwd_kda, args, kwargs)
    dv = kk._out(args[1].shape, args[1].dtype, args[1].device).fill_(float("nan"))
    flagged_only = _run_stage10(kk.chunk_wy_bwd_kda, args, kwargs, only_flagged=True, dv=dv)
    for name in ("dv",) + FOR_10B:
        assert torch.equal(flagged_only[name][rows], whole[name][rows]), f"{name}: the flagged chunks differ"
    assert flagged_only["dv"][~rows].isnan().all(), "dv: the flagged-only launch wrote an unflagged chunk"
    for name in FINAL:
        assert flagged_only[name].isnan().all(), f"{name}: the flagged-only launch wrote a final output"
    for name, i in (("dK'", 9), ("dG'", 10)):  # left as stage 9 wrote them where the chunk is not flagged
        assert torch.equal(flagged_only[name][~rows], args[i][~rows]), name


def test_rule(monkeypatch):
    """The Gluon kernel takes stage 10 with the switch on, tf32 products, fp32 operands (k and v any
    dtype; dVn fp32 or bf16), contiguous operands, per-channel fp32 G, K == V of 64 or 128, int8 flags given and 10b
    fused, on the GPU; each condition refused alone."""
    from tileport.ops.kda import gluon_kernels as kg

    if kg._GLUON_ERROR is not None:
        pytest.skip(kg._GLUON_ERROR)
    f32 = OnGPU(torch.float32, 3, (64, 2, 128))
    G = OnGPU(torch.float32, 3, (64, 2, 128))
    k16 = OnGPU(torch.bfloat16, 3, (64, 2, 128))
    ops = (f32, f32) + (f32,) * 7
    flags, outs = OnGPU(torch.int8, 2, (4, 2)), object()
    monkeypatch.setattr(kg, "BACKWARD_WY", "gluon")
    assert kg.wy_bwd_kernel_for(ops, G, torch.bfloat16, flags, outs) == "gluon"
    assert kg.wy_bwd_kernel_for((k16,) + ops[1:], G, torch.bfloat16, flags, outs) == "gluon"
    assert kg.wy_bwd_kernel_for(ops, G, torch.bfloat16, None, outs) == "triton"
    assert kg.wy_bwd_kernel_for(ops, G, torch.bfloat16, flags, None) == "triton"
    assert kg.wy_bwd_kernel_for(ops[:2] + (k16,) + ops[3:], G, torch.bfloat16, flags, outs) == "triton"
    f16 = OnGPU(torch.float16, 3, (64, 2, 128))
    # stage 8's dVn in bf16 (BACKWARD_DSTATES_DTYPE "bf16"): widened by the kernel
    assert kg.wy_bwd_kernel_for(ops[:6] + (k16,) + ops[7:], G, torch.bfloat16, flags, outs) == "gluon"
    for i in (2, 5, 7, 8):  # T, dW, dK', dG' in bf16
        assert kg.wy_bwd_kernel_for(ops[:i] + (k16,) + ops[i + 1:], G, torch.bfloat16, flags, outs) == "triton", i
    # the backward's W in bf16 (BACKWARD_W_DTYPE "bf16"): the split form's dA kernel widens it, the one
    # kernel does not take it
    w16 = ops[:3] + (k16,) + ops[4:]
    assert kg.wy_bwd_kernel_for(w16, G, torch.bfloat16, flags, outs) == "gluon"
    assert kg.wy_bwd_kernel_for(ops[:3] + (f16,) + ops[4:], G, torch.bfloat16, flags, outs) == "triton"
    monkeypatch.setattr(kg, "WY_FORM", "one-kernel")
    assert kg.wy_bwd_kernel_for(w16, G, torch.bfloat16, flags, outs) == "triton"
    monkeypatch.setattr(kg, "WY_FORM", "split")
    assert kg.wy_bwd_kernel_for(ops[:6] + (f16,) + ops[7:], G, torch.bfloat16, flags, outs) == "triton"
    assert kg.wy_bwd_kernel_for(ops, OnGPU(torch.float64, 3, (64, 2, 128)), torch.bfloat16, flags, outs) == "triton"
    assert kg.wy_bwd_kernel_for(ops, G, torch.float32, flags, outs) == "triton"  # fp32 inputs: exact products
    assert kg.wy_bwd_kernel_for(ops, OnGPU(torch.float32, 3, (64, 2, 128), is_cuda=False), torch.bfloat16, flags,
                                outs) == "triton"
    assert kg.wy_bwd_kernel_for(ops, G, torch.bfloat16, OnGPU(torch.bool, 2, (4, 2)), outs) == "triton"
    strided = OnGPU(torch.float32, 3, (64, 2, 128), contiguous=False)
    for i in range(len(ops)):
        assert kg.wy_bwd_kernel_for(ops[:i] + (strided,) + ops[i + 1:], G, torch.bfloat16, flags, outs) == "triton", i
    for K, V in ((128, 64), (32, 32)):
        shaped = (OnGPU(torch.float32, 3, (64, 2, K)), OnGPU(torch.float32, 3, (64, 2, V))) + ops[2:]
        assert kg.wy_bwd_kernel_for(shaped, G, torch.bfloat16, flags, outs) == "triton", (K, V)
    # U never formed (BACKWARD_U_FROM_T): the split form's U_FREE dA kernel takes it, the one-kernel form not
    no_u = ops[:4] + (None,) + ops[5:]
    monkeypatch.setattr(kg, "WY_FORM", "split")
    assert kg.wy_bwd_kernel_for(no_u, G, torch.bfloat16, flags, outs) == "gluon"
    assert kg.wy_bwd_kernel_for(no_u[:6] + (k16,) + no_u[7:], G, torch.bfloat16, flags, outs) == "gluon"  # bf16 dVn
    assert kg.wy_bwd_kernel_for(no_u[:2] + (k16,) + no_u[3:], G, torch.bfloat16, flags, outs) == "triton"
    monkeypatch.setattr(kg, "WY_FORM", "one-kernel")
    assert kg.wy_bwd_kernel_for(no_u, G, torch.bfloat16, flags, outs) == "triton"
    monkeypatch.setattr(kg, "BACKWARD_WY", "triton")
    assert kg.wy_bwd_kernel_for(ops, G, torch.bfloat16, flags, outs) == "triton"
    monkeypatch.setattr(kg, "BACKWARD_WY", "fast")
    with pytest.raises(ValueError, match="BACKWARD_WY"):
        kg.wy_bwd_kernel_for(ops, G, torch.bfloat16, flags, outs)
