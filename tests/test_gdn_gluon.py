"""The GDN "gluon" backend (Triton stages and backward around the Gluon TMA + WGMMA kernels)
through the frozen parity gate's cases, forward and backward, on the shapes it accepts (bf16,
K and V of 64 or 128), in each of its forward forms: the two output kernels (one chunk per
program, and the persistent one with two TMA buffer sets) and the fused recurrence + output in
both launch shapes (BV = 64 on one warpgroup, BV = V on two; the latter in each way of bringing
in the gates, RECURRENCE_GATES, and with o leaving by TMA store, RECURRENCE_O_STORE; the former also
with one TMA buffer set, RECURRENCE_RING 1). GPU only: Gluon kernels don't run on the CPU, where
tests/test_gluon_compile.py compile-checks the kernel for sm_90a instead.
"""

from __future__ import annotations

import pytest
import test_gdn_parity as parity  # a module import: pytest would collect imported test functions
from test_gdn_parity import _one_thread  # noqa: F401 (autouse fixture)

from tileport.ops.gdn import DISPATCHER, explain_call

ACCEPTED = [cid for cid, c in parity.CASES.items() if c[5] == "bf16" and c[3] in (64, 128) and c[4] in (64, 128)]


@pytest.mark.parametrize("form", ["one-shot", "persistent", "fused", "fused-ring1", "fused-wide-late",
                                  "fused-wide-early", "fused-wide-staged", "fused-wide-tma-store"])
@pytest.mark.parametrize("case_id", ACCEPTED)
def test_forward_backward(case_id, form, device, seed, monkeypatch):
    parity._backend_or_skip("gluon", device)
    from tileport.ops.gdn import gluon_kernels

    # every Gluon forward through the same gate: the two output kernels after Triton's stages
    # 1-5 (OUTPUT_FORM), and the fused recurrence + output kernel (FORWARD_FORM)
    if form.startswith("fused"):
        monkeypatch.setattr(gluon_kernels, "FORWARD_FORM", "fused")
        bv, warps = (128, 8) if form.startswith("fused-wide") else (64, 4)
        monkeypatch.setattr(gluon_kernels, "RECURRENCE_BV", bv)
        monkeypatch.setattr(gluon_kernels, "RECURRENCE_WARPS", warps)
        if form in ("fused-wide-late", "fused-wide-early", "fused-wide-staged"):  # RECURRENCE_GATES
            monkeypatch.setattr(gluon_kernels, "RECURRENCE_GATES", form.rsplit("-", 1)[1])
        monkeypatch.setattr(gluon_kernels, "RECURRENCE_RING", 1 if form == "fused-ring1" else 2)
        monkeypatch.setattr(gluon_kernels, "RECURRENCE_O_STORE", "tma" if form == "fused-wide-tma-store" else "masked")
    else:
        monkeypatch.setattr(gluon_kernels, "FORWARD_FORM", "split")
        monkeypatch.setattr(gluon_kernels, "OUTPUT_FORM", form)
    parity._run_and_check("gluon", case_id, device, seed)


def test_explain_says_why_gluon_refuses():
    import torch

    call = explain_call("1,64,1,64,64", torch.float16, "cuda", (9, 0))
    assert "bfloat16 only" in DISPATCHER._by_name["gluon"].refusal(call)
    call = explain_call("1,64,1,48,80", torch.bfloat16, "cuda", (9, 0))
    assert "head dims" in DISPATCHER._by_name["gluon"].refusal(call)
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
