"""KDA's backward stage 7 on the Gluon kernel (`gluon_kernels._kda_dv_local_wgmma_kernel`,
BACKWARD_DV_LOCAL "gluon"): the chunks stage 3 left unflagged on it, the flagged ones on Triton's
kernel into the same buffer (`chunk_dv_local_kda_gluon`). On the GPU: the stage against Triton's
stage 7 on the same inputs (captured from a real backward), route by route, and the whole forward
and backward through `tileport.chunk_kda` against the float64 reference (the parity gate's cases).
On the CPU: the switch's validation, the rule that picks the kernel, the flagged-only launch's
contract, and that the gluon backend's backward routes stage 7 through it;
tests/test_gluon_compile.py compile-checks the kernel for sm_90a.
"""

from __future__ import annotations

import pytest
import test_kda_parity as parity  # a module import: pytest would collect imported test functions
import torch
from kda_stage_cases import KEYS, LAYOUTS, capture_stage, gluon_stage_calls, normwise, route_rows
from standins import operand, spy_on_kernels
from test_kda_gluon import ACCEPTED
from test_kda_parity import _one_thread  # noqa: F401 (autouse fixture)

from tileport.testing import poisoned


@pytest.fixture
def gluon_stage7(monkeypatch):
    """BACKWARD_DV_LOCAL "gluon", and the Gluon kernel's launches recorded (their grids)."""
    from tileport.ops.kda import gluon_kernels as gk

    return spy_on_kernels(monkeypatch, gk, ["_kda_dv_local_wgmma_kernel"], BACKWARD_DV_LOCAL="gluon")[0]


@pytest.mark.parametrize("keys", list(KEYS))
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stage7_matches_triton_route_by_route(layout, K, keys, device, seed, gluon_stage7, monkeypatch):
    """dVl from `chunk_dv_local_kda_gluon` against Triton's `chunk_dv_local_kda` on the same inputs,
    on the rows of unflagged chunks (the Gluon kernel's) and of flagged ones (Triton's kernel in
    both) apart, so that an error in either route cannot hide in the other's mass. The output is
    NaN-poisoned: a chunk no route writes fails. Under each of KEYS: with l2norm and fp32
    normalised keys the whole chunks read the raw 16-bit q and k and normalise them in the kernel
    (DV_LOCAL_RAW_QK), as Triton's whole-chunk launch does; with bf16 normalised keys both read those.
    Bound: both kernels multiply fp32 operands by tf32 WGMMA (Triton's tl.dot at tf32 on sm_90a:
    m64nNk8, truncating), with the same exponents and masks. Where both read the same 16-bit keys
    the operands are the same: 1e-5 normwise per route, the repo's bound for "the same products,
    summed in another order". Normalising in the kernel, each sums a row's squares in its own order (4 warps here, 8 there),
    and a norm 1 ulp apart can move an operand across a tf32 truncation step (2^-10 relative): a
    torch emulation changing only that order, on these captured cases, put the unflagged rows up
    to 3.5e-5 apart (a review's, twenty-ninth session); so 1e-4 there, still far below the gate's
    1e-2 for dv and 10x under what a wrong gate, mask or operand gives (~1e-1 and up)."""
    parity._backend_or_skip("gluon", device)
    from tileport.ops.kda import gluon_kernels as gk
    from tileport.ops.kda import triton_kernels as kk

    l2, normalised_qk = KEYS[keys]
    args, kwargs = capture_stage("dv_local", layout, K, l2, device, normalised_qk)
    flags, plan = kwargs["span_flags"], args[5]
    assert flags is not None and (flags == 0).any() and (flags != 0).any(), f"the draw should flag some chunks: {flags}"
    in_kernel = keys == "l2norm-fp32"  # the raw keys, normalised in each kernel (DV_LOCAL_RAW_QK)
    assert (kwargs["raw_qk"] is not None) == in_kernel, f"{keys}: the whole chunks' keys (DV_LOCAL_RAW_QK)"
    assert args[0].dtype == (torch.float32 if in_kernel else torch.bfloat16), (keys, args[0].dtype)
    want = kk.chunk_dv_local_kda(*args, **kwargs)

    flagged_launches = []
    real = kk.chunk_dv_local_kda
    monkeypatch.setattr(kk, "chunk_dv_local_kda",
                        lambda *a, **kw: flagged_launches.append(kw.get("dvl") is not None) or real(*a, **kw))
    with poisoned():
        got = gk.chunk_dv_local_kda_gluon(*args, **kwargs)
    assert gluon_stage7.grids == [(plan.NC, flags.shape[1])], gluon_stage7.grids
    assert flagged_launches == [True], flagged_launches  # Triton's kernel, flagged chunks only, into our buffer

    unflagged, flagged = (m.to(got.device) for m in route_rows(plan, flags))
    bound = 1e-4 if in_kernel else 1e-5
    for route, rows in (("unflagged", unflagged), ("flagged", flagged)):
        err = normwise(got[rows], want[rows])
        assert err < bound, f"dVl on {route} chunks [{layout} K={K} {keys} seed={seed}]: {err:.2e} from Triton's"


@pytest.mark.parametrize("case_id", ACCEPTED)
def test_forward_backward(case_id, device, seed, gluon_stage7):
    """The parity gate's cases that the gluon backend takes (bf16, K = V of 64 or 128), forward and
    backward through `tileport.chunk_kda`, with stage 7 on the Gluon kernel: against the float64
    reference at the gate's bounds; and the kernel launched once per backward (its programs return
    on flagged chunks)."""
    parity._backend_or_skip("gluon", device)
    parity._run_and_check("gluon", case_id, device, seed)
    assert len(gluon_stage7.grids) == 1, gluon_stage7.grids


# --------------------------------------------------------------------------------------------
# CPU: the switch, the rule, the plumbing
# --------------------------------------------------------------------------------------------
def _rule_operands(K=128, V=128, keys=torch.bfloat16, **changes):
    """dv_local_kernel_for's tensor arguments as the gluon backward hands them (the raw 16-bit keys
    of an l2norm call); `changes` replaces some by name."""
    Ntok, H, NC = 256, 2, 4
    ops = dict(q=operand([Ntok, H, K], keys), k=operand([Ntok, H, K], keys),
               G=operand([Ntok, H, K], torch.float32), do=operand([Ntok, H, V], torch.bfloat16),
               span_flags=operand([NC, H], torch.int8))
    ops.update(changes)
    return ops


def _rule(ops, input_dtype=torch.bfloat16):
    from tileport.ops.kda import gluon_kernels as gk

    return gk.dv_local_kernel_for(ops["q"], ops["k"], ops["G"], ops["do"], input_dtype, ops["span_flags"])


def test_switch_is_validated(monkeypatch):
    from tileport.ops.kda import gluon_kernels as gk

    monkeypatch.setattr(gk, "BACKWARD_DV_LOCAL", "cuda")
    with pytest.raises(ValueError, match="BACKWARD_DV_LOCAL 'cuda'.*'triton', 'gluon'"):
        _rule(_rule_operands())
    with pytest.raises(ValueError, match="BACKWARD_DV_LOCAL"):  # validated before any fallback is decided
        _rule(_rule_operands(span_flags=None))


def test_rule_takes_what_the_kernel_was_compiled_for(monkeypatch):
    from tileport.ops.gdn import triton_kernels as tk
    from tileport.ops.kda import gluon_kernels as gk

    f32, bf, f16 = torch.float32, torch.bfloat16, torch.float16
    monkeypatch.setattr(gk, "BACKWARD_DV_LOCAL", "triton")
    assert _rule(_rule_operands()) == "triton"
    monkeypatch.setattr(gk, "BACKWARD_DV_LOCAL", "gluon")
    if gk._GLUON_ERROR is not None:
        assert _rule(_rule_operands()) == "triton"
        pytest.skip(f"no Gluon here: {gk._GLUON_ERROR}")
    for K in (64, 128):
        assert _rule(_rule_operands(K, K)) == "gluon", K
    assert _rule(_rule_operands(128, 64)) == "gluon"  # K and V apart: each of HEAD_DIMS
    refused = {
        "no flags": _rule_operands(span_flags=None),
        "int32 flags": _rule_operands(span_flags=operand([4, 2], torch.int32)),
        "K = 32": _rule_operands(32, 32),
        "V = 256": _rule_operands(128, 256),
        "fp32 keys (l2norm_fwd's copies)": _rule_operands(keys=f32),
        "fp16 keys (no fp16 shared layout for the descriptors)": _rule_operands(keys=f16),
        "q, k of two dtypes": _rule_operands(k=operand([256, 2, 128], f16)),
        "fp16 dO": _rule_operands(do=operand([256, 2, 128], f16)),
        "fp64 G": _rule_operands(G=operand([256, 2, 128], torch.float64)),
        "fp32 dO": _rule_operands(do=operand([256, 2, 128], f32)),
        "on the CPU": _rule_operands(G=operand([256, 2, 128], f32, is_cuda=False)),
        "strided": _rule_operands(q=operand([256, 2, 128], bf, contiguous=False)),
        "off 16 bytes": _rule_operands(do=operand([256, 2, 128], bf, data_ptr=8)),
    }
    for why, ops in refused.items():
        assert _rule(ops) == "triton", why
    assert _rule(_rule_operands(), input_dtype=f32) == "triton"  # fp32 inputs: exact products
    monkeypatch.setattr(tk, "BACKWARD_PRODUCTS", "bf16x3")
    assert _rule(_rule_operands()) == "triton"


def test_flagged_only_launch_needs_flags():
    """`chunk_dv_local_kda(dvl=...)` (Triton's kernel on the flagged chunks only, beside the Gluon
    kernel) needs the flags that say which chunks those are."""
    from tileport.ops.kda import triton_kernels as kk

    q = torch.zeros(64, 1, 64)
    with pytest.raises(ValueError, match="needs span_flags"):
        kk.chunk_dv_local_kda(q, q, q, q, 1.0, None, torch.bfloat16, span_flags=None, dvl=torch.empty(64, 1, 64))


@pytest.mark.parametrize("keys", list(KEYS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flagged_only_launch_leaves_the_unflagged_chunks(layout, keys, device):
    """`chunk_dv_local_kda(dvl=...)`, the launch after the Gluon kernel, writes the flagged chunks'
    rows (as the full launch does) and leaves every unflagged chunk's row as it found it: were it to
    run the whole-chunk launch too, it would overwrite the Gluon kernel's rows with Triton's, and
    the route-by-route test above would compare Triton's with Triton's."""
    from tileport.dispatch import interpreter_enabled
    from tileport.ops.kda import triton_kernels as kk

    if device == "cpu" and not interpreter_enabled():
        pytest.skip("the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
    l2, normalised_qk = KEYS[keys]
    args, kwargs = capture_stage("dv_local", layout, 64, l2, device, normalised_qk)
    plan, flags = args[5], kwargs["span_flags"]
    want = kk.chunk_dv_local_kda(*args, **kwargs)
    sentinel = 12345.0
    buf = torch.full_like(want, sentinel)
    got = kk.chunk_dv_local_kda(*args, **kwargs, dvl=buf)
    assert got is buf
    unflagged, flagged = (m.to(got.device) for m in route_rows(plan, flags))
    assert unflagged.any() and flagged.any()
    assert bool((got[unflagged] == sentinel).all()), "the flagged-only launch wrote an unflagged chunk's row"
    assert torch.equal(got[flagged], want[flagged]), "the flagged chunks' rows differ from the full launch's"


@pytest.mark.parametrize("normalised_qk", ["fp32", "input"])
def test_gluon_backward_runs_stage7_through_the_gluon_stage(normalised_qk, monkeypatch):
    """Plumbing: `kda_backward_gluon` hands stage 7 to `chunk_dv_local_kda_gluon` with the flags and,
    with l2norm and fp32 normalised keys, the raw keys (none with bf16 ones: the kernel reads those as
    given); off the GPU that stage falls back to Triton's, so the gradients are Triton's backward's,
    bitwise, with the switch on."""
    from tileport.ops.kda import triton_kernels as kk

    monkeypatch.setattr(kk, "BACKWARD_NORMALISED_QK", normalised_qk)
    calls = gluon_stage_calls(monkeypatch, "BACKWARD_DV_LOCAL", "chunk_dv_local_kda_gluon")
    assert len(calls) == 1 and calls[0]["span_flags"] is not None, calls
    assert (calls[0]["raw_qk"] is not None) == (normalised_qk == "fp32"), calls
