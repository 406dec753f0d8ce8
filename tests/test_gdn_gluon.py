"""The GDN "gluon" backend (Triton stages and backward around the Gluon TMA + WGMMA kernels)
through the frozen parity gate's cases, forward and backward, on the shapes it accepts (bf16,
K and V of 64 or 128), in each of its forward forms: the two output kernels (one chunk per
program, and the persistent one with two TMA buffer sets) and the fused recurrence + output. GPU only: Gluon kernels don't run on the CPU, where
tests/test_gluon_compile.py compile-checks the kernel for sm_90a instead.
"""

from __future__ import annotations

import pytest
import test_gdn_parity as parity  # a module import: pytest would collect imported test functions
from test_gdn_parity import _one_thread  # noqa: F401 (autouse fixture)

from tileport.ops.gdn import DISPATCHER, explain_call

ACCEPTED = [cid for cid, c in parity.CASES.items() if c[5] == "bf16" and c[3] in (64, 128) and c[4] in (64, 128)]


@pytest.mark.parametrize("form", ["one-shot", "persistent", "fused"])
@pytest.mark.parametrize("case_id", ACCEPTED)
def test_forward_backward(case_id, form, device, seed, monkeypatch):
    parity._backend_or_skip("gluon", device)
    from tileport.ops.gdn import gluon_kernels

    # every Gluon forward through the same gate: the two output kernels after Triton's stages
    # 1-5 (OUTPUT_FORM), and the fused recurrence + output kernel (FORWARD_FORM)
    if form == "fused":
        monkeypatch.setattr(gluon_kernels, "FORWARD_FORM", "fused")
    else:
        monkeypatch.setattr(gluon_kernels, "OUTPUT_FORM", form)
    parity._run_and_check("gluon", case_id, device, seed)


def test_explain_says_why_gluon_refuses():
    import torch

    call = explain_call("1,64,1,64,64", torch.float16, "cuda", (9, 0))
    assert "bfloat16 only" in DISPATCHER._by_name["gluon"].refusal(call)
    call = explain_call("1,64,1,48,80", torch.bfloat16, "cuda", (9, 0))
    assert "head dims" in DISPATCHER._by_name["gluon"].refusal(call)
    assert "Hopper" in DISPATCHER._by_name["gluon"].refusal(explain_call("1,64,1,64,64", torch.bfloat16, "cuda", (8, 0)))
