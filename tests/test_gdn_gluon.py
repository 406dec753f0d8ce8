"""The GDN "gluon" backend (Triton stages and backward around the Gluon TMA + WGMMA kernels)
through the frozen parity gate's cases, forward and backward, on the shapes it accepts (bf16,
K = V of 64 or 128), in each of its forward forms: the two output kernels (one chunk per
program, and the persistent one with two TMA buffer sets) and the fused recurrence + output in
both launch shapes (BV = 64 on one warpgroup, BV = V on two; the latter in each way of bringing
in the gates, RECURRENCE_GATES, and with o leaving by TMA store, RECURRENCE_O_STORE; the former also
with one TMA buffer set, RECURRENCE_RING 1); and the backward's two state recurrences (the
recompute's stage 5 and stage 8) on the Gluon kernel in both launch shapes and on Triton's (the
stages share one contract, so the mixed pairs are not kept: they were in the H200 run at a8d219f,
cut at 85 s with 40 passed and none failed, and the loop's whole gate must fit one device call);
and stage 9's state part on its Gluon kernel in both forms (a program per key block, or one looping
over them). GPU only: Gluon kernels don't run on the CPU, where
tests/test_gluon_compile.py compile-checks the kernel for sm_90a instead.
"""

from __future__ import annotations

import pytest
import test_gdn_parity as parity  # a module import: pytest would collect imported test functions
from test_gdn_parity import _one_thread  # noqa: F401 (autouse fixture)
from standins import OnGPU

from tileport.ops.gdn import DISPATCHER, explain_call

ACCEPTED = [cid for cid, c in parity.CASES.items() if c[5] == "bf16" and c[3] == c[4] and c[3] in (64, 128)]


# every Gluon form, each switch it depends on set explicitly: the forward's (FORWARD_FORM,
# OUTPUT_FORM, RECURRENCE_BV, RECURRENCE_WARPS, RECURRENCE_GATES, RECURRENCE_RING,
# RECURRENCE_O_STORE) and the backward's (BACKWARD_STATES, BACKWARD_DSTATES, TF32_RECURRENCE_BV,
# TF32_RECURRENCE_WARPS, BACKWARD_DQKWG, DQKWG_STATE_FORM, BACKWARD_WY, DQK_LOCAL, DQK_LOCAL_AT,
# WY_L2NORM_K)
_DSTATES = ("gluon", "gluon", 128, 8, "triton", "per-block", "triton", "triton", "stage-9", "apart")  # the backward's recurrences in Gluon, BV 128 on two warpgroups
FORMS = {
    "one-shot": ("split", "one-shot", 64, 4, "staged", 2, "masked", *_DSTATES),  # the output kernels after Triton's 1-5
    "persistent": ("split", "persistent", 64, 4, "staged", 2, "masked", *_DSTATES),
    "fused": ("fused", "one-shot", 64, 4, "staged", 2, "masked", *_DSTATES),  # one warpgroup, BV 64
    "fused-ring1": ("fused", "one-shot", 64, 4, "staged", 1, "masked", *_DSTATES),  # one TMA buffer set: 2 programs per SM
    "fused-wide-late": ("fused", "one-shot", 128, 8, "late", 2, "masked", *_DSTATES),  # two warpgroups, BV 128
    "fused-wide-early": ("fused", "one-shot", 128, 8, "early", 2, "masked", *_DSTATES),
    "fused-wide-staged": ("fused", "one-shot", 128, 8, "staged", 2, "masked", *_DSTATES),
    "fused-wide-tma-store": ("fused", "one-shot", 128, 8, "staged", 2, "tma", *_DSTATES),
    "recurrences-BV64-4w": ("fused", "one-shot", 128, 8, "staged", 2, "tma", "gluon", "gluon", 64, 4, "triton", "per-block",
                            "triton", "triton", "stage-9", "apart"),
    "recurrences-triton": ("fused", "one-shot", 128, 8, "staged", 2, "tma", "triton", "triton", 128, 8, "triton",
                           "per-block", "triton", "triton", "stage-9", "apart"),
    "dqkwg-gluon": ("fused", "one-shot", 128, 8, "staged", 2, "tma", "gluon", "gluon", 128, 8, "gluon", "per-block",
                    "triton", "triton", "stage-9", "apart"),
    "dqkwg-gluon-loop": ("fused", "one-shot", 128, 8, "staged", 2, "tma", "gluon", "gluon", 128, 8, "gluon", "loop",
                         "triton", "triton", "stage-9", "apart"),
    "wy-gluon": ("fused", "one-shot", 128, 8, "staged", 2, "tma", "gluon", "gluon", 128, 8, "gluon", "loop", "gluon",
                 "triton", "stage-9", "apart"),
    "dqk-local-gluon": ("fused", "one-shot", 128, 8, "staged", 2, "tma", "gluon", "gluon", 128, 8, "gluon", "loop",
                        "gluon", "gluon", "stage-9", "apart"),
    "dqk-local-at-7": ("fused", "one-shot", 128, 8, "staged", 2, "tma", "gluon", "gluon", 128, 8, "gluon", "loop",
                       "gluon", "gluon", "stage-7", "apart"),  # 9a with stage 7 in one launch
    "wy-l2norm-fused": ("fused", "one-shot", 128, 8, "staged", 2, "tma", "gluon", "gluon", 128, 8, "gluon", "loop",
                        "gluon", "gluon", "stage-9", "fused"),  # k's l2norm backward in stage 10's kernel
}
_SWITCHES = ("FORWARD_FORM", "OUTPUT_FORM", "RECURRENCE_BV", "RECURRENCE_WARPS", "RECURRENCE_GATES", "RECURRENCE_RING",
             "RECURRENCE_O_STORE", "BACKWARD_STATES", "BACKWARD_DSTATES", "TF32_RECURRENCE_BV", "TF32_RECURRENCE_WARPS",
             "BACKWARD_DQKWG", "DQKWG_STATE_FORM", "BACKWARD_WY", "DQK_LOCAL", "DQK_LOCAL_AT", "WY_L2NORM_K")


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("case_id", ACCEPTED)
def test_forward_backward(case_id, form, device, seed, monkeypatch):
    parity._backend_or_skip("gluon", device)
    from tileport.ops.gdn import gluon_kernels

    for name, value in zip(_SWITCHES, FORMS[form]):
        monkeypatch.setattr(gluon_kernels, name, value)
    parity._run_and_check("gluon", case_id, device, seed)


def test_explain_says_why_gluon_refuses():
    import torch

    call = explain_call("1,64,1,64,64", torch.float16, "cuda", (9, 0))
    assert "bfloat16 only" in DISPATCHER._by_name["gluon"].refusal(call)
    call = explain_call("1,64,1,48,80", torch.bfloat16, "cuda", (9, 0))
    assert "head dims" in DISPATCHER._by_name["gluon"].refusal(call)
    call = explain_call("1,64,1,64,128", torch.bfloat16, "cuda", (9, 0))
    assert "K == V only" in DISPATCHER._by_name["gluon"].refusal(call)
    assert "Hopper" in DISPATCHER._by_name["gluon"].refusal(explain_call("1,64,1,64,64", torch.bfloat16, "cuda", (8, 0)))


def test_forward_form_rule_and_refusal(monkeypatch):
    """FORWARD_FORM "auto" follows Triton's STATES_FORM rule; an unknown form is refused by name
    (CPU: nothing launches)."""
    from tileport.ops.gdn import gluon_kernels, triton_kernels

    monkeypatch.setattr(gluon_kernels, "FORWARD_FORM", "auto")
    monkeypatch.setattr(triton_kernels, "STATES_FORM", "auto")
    many, few = triton_kernels.FUSED_STATES_MIN_PAIRS, triton_kernels.FUSED_STATES_MIN_PAIRS - 1
    assert (gluon_kernels.forward_form(many), gluon_kernels.forward_form(few)) == ("fused", "triton")
    monkeypatch.setattr(gluon_kernels, "FORWARD_FORM", "ping-pong")
    with pytest.raises(ValueError, match="FORWARD_FORM"):
        gluon_kernels.forward_form(many)


@pytest.mark.parametrize("switch, bad", [("RECURRENCE_WARPS", 12), ("RECURRENCE_BV", 48),
                                         ("RECURRENCE_GATES", "prefetched"), ("RECURRENCE_RING", 3),
                                         ("RECURRENCE_O_STORE", "async")])
def test_fused_launch_refuses(switch, bad, monkeypatch):
    """A value of one of the fused kernel's launch switches it cannot take is refused by name, the
    others at their defaults (CPU: nothing launches)."""
    from tileport.ops.gdn import gluon_kernels

    gluon_kernels.check_recurrence_launch(128)  # the defaults pass
    monkeypatch.setattr(gluon_kernels, switch, bad)
    with pytest.raises(ValueError, match=switch):
        gluon_kernels.check_recurrence_launch(128)


@pytest.mark.parametrize("switch, bad", [("TF32_RECURRENCE_WARPS", 12), ("TF32_RECURRENCE_BV", 32),
                                         ("BACKWARD_DSTATES", "cuda"), ("BACKWARD_STATES", "cuda"),
                                         ("BACKWARD_DQKWG", "cuda"), ("DQKWG_STATE_FORM", "tiled"),
                                         ("BACKWARD_WY", "cuda"), ("DQK_LOCAL", "tiled"),
                                         ("DQK_LOCAL_AT", "stage-8"), ("WY_L2NORM_K", "inline")])
def test_tf32_recurrence_launch_refuses(switch, bad, monkeypatch):
    """A value of the backward recurrences' switches the Gluon kernel cannot take is refused by
    name, the others at their defaults (CPU: nothing launches)."""
    import torch

    from tileport.ops.gdn import gluon_kernels

    x = torch.zeros(64, 1, 128)
    g = torch.zeros(64, 1, dtype=torch.float64)
    gluon_kernels.check_tf32_recurrence_launch(128)  # the defaults pass
    for stage in ("states", "dstates"):  # CPU tensors: Triton's kernels
        assert gluon_kernels.recurrence_kernel_for(stage, (x, x, x), g, torch.bfloat16, 1024) == "triton"
    assert gluon_kernels.dqkwg_kernel_for((x, x), g, torch.bfloat16) == "triton"
    assert gluon_kernels.wy_bwd_kernel_for((x, x, x), g, torch.bfloat16) == "triton"
    monkeypatch.setattr(gluon_kernels, switch, bad)
    with pytest.raises(ValueError, match=switch):
        gluon_kernels.check_tf32_recurrence_launch(128)
        for stage in ("states", "dstates"):
            gluon_kernels.recurrence_kernel_for(stage, (x, x, x), g, torch.bfloat16, 1024)
        gluon_kernels.dqkwg_kernel_for((x, x), g, torch.bfloat16)
        gluon_kernels.wy_bwd_kernel_for((x, x, x), g, torch.bfloat16)


def test_backward_states_rule(monkeypatch):
    """BACKWARD_STATES "auto" takes the Gluon recompute from TF32_STATES_MIN_PAIRS (sequence, head)
    pairs (fp32 operands, tf32 products, on the GPU), Triton's below; "auto" is refused for stage 8."""
    import torch

    from tileport.ops.gdn import gluon_kernels

    x, g = OnGPU(torch.float32, 3), OnGPU(torch.float64, 2)
    many = gluon_kernels.TF32_STATES_MIN_PAIRS
    monkeypatch.setattr(gluon_kernels, "BACKWARD_STATES", "auto")
    assert gluon_kernels.recurrence_kernel_for("states", (x, x, x), g, torch.bfloat16, many) == "gluon"
    assert gluon_kernels.recurrence_kernel_for("states", (x, x, x), g, torch.bfloat16, many - 1) == "triton"
    assert gluon_kernels.recurrence_kernel_for("dstates", (x, x, x), g, torch.bfloat16, 1) == "gluon"
    assert gluon_kernels.recurrence_kernel_for("states", (OnGPU(torch.bfloat16, 3), x, x), g, torch.bfloat16,
                                               many) == "triton"  # a 16-bit operand: Triton's
    monkeypatch.setattr(gluon_kernels, "BACKWARD_DSTATES", "auto")
    with pytest.raises(ValueError, match="BACKWARD_DSTATES"):
        gluon_kernels.recurrence_kernel_for("dstates", (x, x, x), g, torch.bfloat16, many)


def test_gluon_backward_plumbing_on_the_cpu(monkeypatch):
    """gdn_backward_gluon hands its recurrences to Triton's where the Gluon kernel does not take
    them (here: CPU tensors, under the interpreter) and gives Triton's gradients, bitwise."""
    import torch

    from tileport.dispatch import interpreter_enabled
    from tileport.ops.gdn import gluon_kernels, triton_kernels

    if not interpreter_enabled():
        pytest.skip("the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
    torch.manual_seed(0)
    B, T, H, K = 1, 70, 1, 64  # a head dim the gluon backend takes
    q, k, v = (torch.randn(B, T, H, K, dtype=torch.bfloat16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H))
    beta = torch.rand(B, T, H, dtype=torch.bfloat16)
    do = torch.randn(B, T, H, K, dtype=torch.bfloat16)
    h0 = torch.randn(B, H, K, K)
    args = (do, None, q, k, v, g, beta, K ** -0.5, h0, True, None)
    theirs = triton_kernels.gdn_backward_triton(*args)
    for dqkwg, place in (("triton", "stage-9"), ("gluon", "stage-9"), ("gluon", "stage-7")):
        monkeypatch.setattr(gluon_kernels, "BACKWARD_DQKWG", dqkwg)
        monkeypatch.setattr(gluon_kernels, "DQK_LOCAL_AT", place)
        ours = gluon_kernels.gdn_backward_gluon(*args)
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)


class _RecordingLaunch:
    """Stands in for a Gluon kernel on the CPU: `kernel[grid](*args, **kwargs)` records the call
    and runs `effect(args)` (say, filling an output)."""

    def __init__(self, effect=None):
        self.calls = []
        self.effect = effect

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            if self.effect is not None:
                self.effect(args)

        return launch


def test_stage_9a_at_stage_7_hands_its_results_to_stage_9(monkeypatch):
    """DQK_LOCAL_AT 'stage-7' (host plumbing, the Gluon launches stubbed on the CPU):
    chunk_dv_local_gluon runs 9a with stage 7 in one launch and keeps dql, dkl and 9a's partial of
    dG; chunk_dqkwg_gluon hands exactly those to 9b's kernel (9a not launched again), puts the
    partial last in dG, and uses the handoff once."""
    import torch

    from tileport.ops.gdn import gluon_kernels, triton_kernels

    for name, value in (("DQK_LOCAL_AT", "stage-7"), ("DQK_LOCAL", "gluon"), ("BACKWARD_DQKWG", "gluon"),
                        ("DQKWG_STATE_FORM", "loop")):
        monkeypatch.setattr(gluon_kernels, name, value)
    monkeypatch.setattr(gluon_kernels, "_gluon_takes", lambda stage, operands, G, input_dtype: True)
    launches = []

    def dqk_local(q, k, vn, do, G, dql, dkl, dG9a, dvl, plan, scale):
        launches.append(dvl is not None)
        dql.fill_(1.0)
        dkl.fill_(2.0)
        dG9a.fill_(3.0)
        if dvl is not None:
            dvl.fill_(4.0)

    monkeypatch.setattr(gluon_kernels, "_launch_dqk_local", dqk_local)
    state_kernel = _RecordingLaunch()
    monkeypatch.setattr(gluon_kernels, "_dqkwg_state_kernel", state_kernel)
    Ntok, H, K = 130, 2, 64
    plan = triton_kernels.make_plan(1, Ntok, None, "cpu")
    q, k, vn, dvn = (torch.randn(Ntok, H, K) for _ in range(4))
    do = torch.randn(Ntok, H, K).to(torch.bfloat16)
    G = torch.zeros(Ntok, H, dtype=torch.float64)
    h, dh = (torch.randn(plan.NC, H, K, K) for _ in range(2))
    held = {}
    dvl = gluon_kernels.chunk_dv_local_gluon(q, k, G, do, 0.1, plan, input_dtype=torch.bfloat16, vn=vn, held=held)
    assert launches == [True] and dvl.shape == (Ntok, H, K) and bool((dvl == 4.0).all())
    dql, dkl, _ = held["local"]
    _dq, _dk, _dw, dG = gluon_kernels.chunk_dqkwg_gluon(q, k, G, h, dh, vn, dvn, do, 0.1, plan, torch.float32,
                                                       input_dtype=torch.bfloat16, held=held)
    assert launches == [True] and "local" not in held
    (_grid, args, _kwargs), = state_kernel.calls
    assert any(a is dql for a in args) and any(a is dkl for a in args)
    assert bool((dG[-1] == 3.0).all())
    # without the handoff (stage 9a at stage 9) stage 9 launches 9a itself
    gluon_kernels.chunk_dqkwg_gluon(q, k, G, h, dh, vn, dvn, do, 0.1, plan, torch.float32, input_dtype=torch.bfloat16,
                                    held={})
    assert launches == [True, False]


def test_stage_10_takes_the_keys_normalisation_back_where_asked(monkeypatch):
    """WY_L2NORM_K (host plumbing, the Gluon launch stubbed on the CPU): 'fused' launches stage 10's
    kernel with L2NORM_K and the raw keys, dk in the dtype asked for; 'apart' launches it for fp32
    dK and then runs Triton's l2norm_bwd on it (its result: l2norm_bwd's, bitwise)."""
    import torch

    from tileport.dispatch import interpreter_enabled
    from tileport.ops.gdn import gluon_kernels, triton_kernels

    monkeypatch.setattr(gluon_kernels, "BACKWARD_WY", "gluon")
    monkeypatch.setattr(gluon_kernels, "_gluon_takes", lambda stage, operands, G, input_dtype: True)
    DK, KRAW = 11, 16  # `_wy_bwd_tf32_kernel`'s dk_ptr and kraw_ptr, by position
    wy_kernel = _RecordingLaunch(lambda args: args[DK].copy_(torch.randn(args[DK].shape)))
    monkeypatch.setattr(gluon_kernels, "_wy_bwd_tf32_kernel", wy_kernel)
    Ntok, H, K = 130, 2, 64
    plan = triton_kernels.make_plan(1, Ntok, None, "cpu")
    kn, w, u, dw, dvn, dkp = (torch.randn(Ntok, H, K) for _ in range(6))
    v, raw_k = (torch.randn(Ntok, H, K).to(torch.bfloat16) for _ in range(2))
    beta = torch.rand(Ntok, H).to(torch.bfloat16)
    G = torch.zeros(Ntok, H, dtype=torch.float64)
    Ai = torch.randn(Ntok, H, 64)
    dGp = torch.randn(3, Ntok, H)
    args = (kn, v, beta, G, Ai, w, u, dw, dvn, dkp, dGp, plan, torch.bfloat16, torch.bfloat16, torch.bfloat16,
            torch.float32)
    monkeypatch.setattr(gluon_kernels, "WY_L2NORM_K", "fused")
    dk, *_ = gluon_kernels.chunk_wy_bwd_gluon(*args, input_dtype=torch.bfloat16, raw_k=raw_k)
    (_grid, launch_args, _kwargs), = wy_kernel.calls
    assert dk.dtype == torch.bfloat16 and launch_args[DK] is dk
    assert launch_args[KRAW] is raw_k and launch_args[-1] is True  # L2NORM_K
    if not interpreter_enabled():
        return  # the 'apart' form runs Triton's l2norm_bwd: under the interpreter on a CPU
    monkeypatch.setattr(gluon_kernels, "WY_L2NORM_K", "apart")
    dk, *_ = gluon_kernels.chunk_wy_bwd_gluon(*args, input_dtype=torch.bfloat16, raw_k=raw_k)
    (_grid, launch_args, _kwargs) = wy_kernel.calls[1]
    assert launch_args[-1] is False and launch_args[DK].dtype == torch.float32
    assert dk.dtype == torch.bfloat16
    assert torch.equal(dk, triton_kernels.l2norm_bwd(raw_k, launch_args[DK], torch.bfloat16))
