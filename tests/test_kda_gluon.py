"""The KDA "gluon" backend (Triton's stages with the output's whole chunks on a Gluon TMA + WGMMA
kernel, and the backward's state recurrences on GDN's Gluon tf32 kernel) through the frozen parity gate's cases, forward and backward, on the shapes it accepts
(bf16, K = V of 64 or 128), with the backward's two state recurrences on GDN's Gluon tf32
kernel (PER_CHANNEL) or on Triton's. The gate's gate kinds give both routes: "normal" and "near0"
gates leave every chunk to the Gluon kernel, "split" and "mixed" ones flag chunks for Triton's
block kernel. GPU only but for the plumbing and rule checks: on the CPU
tests/test_gluon_compile.py compile-checks the kernels for sm_90a instead.
"""

from __future__ import annotations

import pytest
import test_kda_parity as parity  # a module import: pytest would collect imported test functions
import torch
from test_kda_parity import _one_thread  # noqa: F401 (autouse fixture)
from standins import OnGPU

from tileport.ops.kda import DISPATCHER, explain_call

ACCEPTED = [cid for cid, c in parity.CASES.items() if c[5] == "bf16" and c[3] == c[4] and c[3] in (64, 128)]


# the backward's two state recurrences (the recompute's stage 5 and stage 8): both on GDN's Gluon
# tf32 kernel in its PER_CHANNEL form (where it takes them: tf32 products on fp32 operands, i.e.
# l2-normalised q and k), or both on Triton's (BACKWARD_STATES "auto", the default, picks by the
# number of (sequence, head) pairs, so the gate's small cases would not reach the Gluon recompute)
RECURRENCES = ("gluon", "triton")


@pytest.mark.parametrize("recurrences", RECURRENCES)
@pytest.mark.parametrize("case_id", ACCEPTED)
def test_forward_backward(case_id, recurrences, device, seed, monkeypatch):
    parity._backend_or_skip("gluon", device)
    from tileport.ops.gdn import gluon_kernels as gdn_gluon

    monkeypatch.setattr(gdn_gluon, "BACKWARD_STATES", recurrences)
    monkeypatch.setattr(gdn_gluon, "BACKWARD_DSTATES", recurrences)
    parity._run_and_check("gluon", case_id, device, seed)


def _recurrence_launches(monkeypatch) -> list:
    """GDN's Gluon recurrence launches, recorded as they run: (backward, the dtype of its A operand's
    tensor: K for stage 8, W for stage 5's recompute), in launch order."""
    from tileport.ops.gdn import gluon_kernels as gdn_gluon

    launches = []
    real = gdn_gluon._launch_tf32_recurrence
    monkeypatch.setattr(gdn_gluon, "_launch_tf32_recurrence",
                        lambda *args, backward: launches.append((backward, args[0].dtype)) or real(*args, backward=backward))
    return launches


@pytest.mark.parametrize("keep_states", [False, True], ids=["recompute", "kept-states"])
@pytest.mark.parametrize("case_id,gluon_runs", [("T65-bf16-l2-near0", True), ("T200-bf16-split-binarybeta", False)])
def test_recurrences_run_where_the_gluon_kernel_takes_them(case_id, gluon_runs, keep_states, device, seed,
                                                           monkeypatch):
    """With l2-normalised q and k in fp32 in the backward (BACKWARD_NORMALISED_QK "fp32"; the Gluon
    stage 8's 16-bit keys form off) both recurrences launch the Gluon kernel (stage 5's recompute,
    then 8, per backward; stage 8 alone where the forward's fused kernel kept every chunk's h and Vn:
    KEEP_FORWARD_STATES); without l2norm, q and k stay 16-bit and Triton's kernels run. The bf16 keys
    of the default: test_bf16_keys_take_the_gluon_stage8."""
    parity._backend_or_skip("gluon", device)
    from tileport.ops.gdn import gluon_kernels as gdn_gluon
    from tileport.ops.kda import triton_kernels

    monkeypatch.setattr(triton_kernels, "BACKWARD_NORMALISED_QK", "fp32")
    monkeypatch.setattr(gdn_gluon, "DSTATES_16BIT_KEYS", False)
    monkeypatch.setattr(gdn_gluon, "BACKWARD_STATES", "gluon")
    monkeypatch.setattr(triton_kernels, "KEEP_FORWARD_STATES", keep_states)
    launches = _recurrence_launches(monkeypatch)
    parity._run_and_check("gluon", case_id, device, seed)
    seen = [backward for backward, _ in launches]
    per_backward = [True] if keep_states else [False, True]
    assert (seen[:len(per_backward)] == per_backward) if gluon_runs else not seen, (case_id, seen)


@pytest.mark.parametrize("case_id", ACCEPTED)
def test_bf16_keys_take_the_gluon_stage8(case_id, device, seed, monkeypatch):
    """The backward's normalised q and k in bf16 (BACKWARD_NORMALISED_QK "input", the default) with
    stage 8 on GDN's Gluon recurrence taking them (its A_LOADS form, DSTATES_16BIT_KEYS, the default):
    the gate's cases against the float64 reference at its bounds, and stage 8's launch seen with
    16-bit keys (the l2norm cases' normalised ones, the others' raw ones)."""
    parity._backend_or_skip("gluon", device)
    from tileport.ops.gdn import gluon_kernels as gdn_gluon
    from tileport.ops.kda import triton_kernels

    monkeypatch.setattr(triton_kernels, "BACKWARD_NORMALISED_QK", "input")
    monkeypatch.setattr(gdn_gluon, "DSTATES_16BIT_KEYS", True)
    launches = _recurrence_launches(monkeypatch)
    parity._run_and_check("gluon", case_id, device, seed)
    keys = [dtype for backward, dtype in launches if backward]  # stage 8's (stage 5's are backward=False)
    assert keys and all(dtype == torch.bfloat16 for dtype in keys), (case_id, keys)


def test_gluon_backward_falls_back_to_triton_off_the_gpu():
    """Plumbing only: kda_backward_gluon's stage parameters reach Triton's backward and, where the
    Gluon kernel does not take the recurrences (here: CPU tensors, under the interpreter), give
    Triton's gradients bitwise. The Gluon path itself is checked on the GPU by the gate's cases and
    test_recurrences_run_where_the_gluon_kernel_takes_them."""
    from tileport.dispatch import interpreter_enabled
    from tileport.ops.kda import gluon_kernels, triton_kernels

    if not interpreter_enabled():
        pytest.skip("the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
    args = plumbing_backward_args()
    for ours, theirs in zip(gluon_kernels.kda_backward_gluon(*args), triton_kernels.kda_backward_triton(*args)):
        assert torch.equal(ours, theirs)


def plumbing_backward_args() -> tuple:
    """`kda_backward_*`'s arguments for a small CPU call (l2norm, an initial state, one chunk and a
    tail): the plumbing tests' case, here and in tests/test_kda_gluon_stage9.py."""
    torch.manual_seed(0)
    B, T, H, K = 1, 70, 1, 64
    q, k, v = (torch.randn(B, T, H, K, dtype=torch.bfloat16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K))
    beta = torch.rand(B, T, H, dtype=torch.bfloat16)
    do = torch.randn(B, T, H, K, dtype=torch.bfloat16)
    return (do, None, q, k, v, g, beta, K ** -0.5, torch.randn(B, H, K, K), True, None)


def test_per_channel_gates_take_the_gluon_recurrences(monkeypatch):
    """GDN's rule for its Gluon recurrences takes KDA's per-channel gates ([Ntok, H, K]) too, on the
    same terms: fp32 operands, tf32 products, on the GPU."""
    from tileport.ops.gdn import gluon_kernels as gdn_gluon

    x, g = OnGPU(torch.float32, 3), OnGPU(torch.float32, 3)
    monkeypatch.setattr(gdn_gluon, "BACKWARD_STATES", "gluon")
    for stage in ("states", "dstates"):
        assert gdn_gluon.recurrence_kernel_for(stage, (x, x, x), g, torch.bfloat16) == "gluon"
        assert gdn_gluon.recurrence_kernel_for(stage, (OnGPU(torch.bfloat16, 3), x, x), g, torch.bfloat16) == "triton"
    # the other Gluon stages of GDN's backward have no per-channel form
    assert not gdn_gluon._gluon_takes("dqkwg", (x, x, x), g, torch.bfloat16)


def test_stage8_takes_bf16_keys_where_asked(monkeypatch):
    """Stage 8 (dstates) on bf16 q and k with fp32 W (BACKWARD_NORMALISED_QK "input"): the Gluon
    kernel's A_LOADS form where DSTATES_16BIT_KEYS is on, Triton's otherwise; never stage 5, per-head
    gates, one 16-bit key alone, or an fp16 W (a bf16 W is taken since BACKWARD_W_DTYPE: the kernel
    widens it)."""
    from tileport.ops.gdn import gluon_kernels as gdn_gluon

    x, g, b = OnGPU(torch.float32, 3), OnGPU(torch.float32, 3), OnGPU(torch.bfloat16, 3)
    monkeypatch.setattr(gdn_gluon, "BACKWARD_STATES", "gluon")
    monkeypatch.setattr(gdn_gluon, "DSTATES_16BIT_KEYS", False)
    assert gdn_gluon.recurrence_kernel_for("dstates", (b, b, x), g, torch.bfloat16) == "triton"
    monkeypatch.setattr(gdn_gluon, "DSTATES_16BIT_KEYS", True)
    assert gdn_gluon.recurrence_kernel_for("dstates", (b, b, x), g, torch.bfloat16) == "gluon"
    assert gdn_gluon.recurrence_kernel_for("dstates", (b, b, b), g, torch.bfloat16) == "gluon"  # bf16 W too
    for why, operands, gates in (("stage 5", None, g), ("per-head gates", (b, b, x), OnGPU(torch.float32, 2)),
                                 ("q alone", (b, x, x), g), ("k alone", (x, b, x), g),
                                 ("fp16 W", (b, b, OnGPU(torch.float16, 3)), g)):
        stage = "states" if operands is None else "dstates"
        assert gdn_gluon.recurrence_kernel_for(stage, operands or (b, b, x), gates, torch.bfloat16) == "triton", why
    monkeypatch.setattr(gdn_gluon, "DSTATES_16BIT_KEYS", "yes")
    with pytest.raises(ValueError, match="DSTATES_16BIT_KEYS"):
        gdn_gluon.recurrence_kernel_for("dstates", (x, x, x), g, torch.bfloat16)


@pytest.mark.parametrize("case_id,flagged", [("T200-bf16-split-binarybeta", True), ("T65-bf16-l2-near0", False)])
def test_cases_take_both_routes(case_id, flagged, device, seed, monkeypatch):
    """A "split" case sends chunks to Triton's block kernel (stage 3 flags them), a "near0" one
    leaves every chunk to the Gluon kernel: both routes of the backend run in this file's cases."""
    parity._backend_or_skip("gluon", device)
    from tileport.ops.kda import triton_kernels

    seen = []
    real = triton_kernels.output_flagged_chunks
    monkeypatch.setattr(triton_kernels, "output_flagged_chunks",
                        lambda *args, **kwargs: seen.append(bool(args[-1].any())) or real(*args, **kwargs))
    parity._run_and_check("gluon", case_id, device, seed)
    assert seen and any(seen) == flagged, (case_id, seen)


def test_explain_says_why_gluon_refuses():
    refusal = DISPATCHER._by_name["gluon"].refusal
    assert "bfloat16 only" in refusal(explain_call("1,64,1,64,64", torch.float16, "cuda", (9, 0)))
    assert "K == V" in refusal(explain_call("1,64,1,48,80", torch.bfloat16, "cuda", (9, 0)))
    assert "K == V" in refusal(explain_call("1,64,1,64,128", torch.bfloat16, "cuda", (9, 0)))
    assert "Hopper" in refusal(explain_call("1,64,1,64,64", torch.bfloat16, "cuda", (8, 0)))
    assert refusal(explain_call("8,4096,16,128,128", torch.bfloat16, "cuda", (9, 0))) is None
