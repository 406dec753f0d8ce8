"""The KDA "gluon" backend (Triton's stages with the output's whole chunks on a Gluon TMA + WGMMA
kernel) through the frozen parity gate's cases, forward and backward, on the shapes it accepts
(bf16, K = V of 64 or 128). The gate's gate kinds give both routes: "normal" and "near0"
gates leave every chunk to the Gluon kernel, "split" and "mixed" ones flag chunks for Triton's
block kernel. GPU only: on the CPU tests/test_gluon_compile.py compile-checks the kernels for
sm_90a instead.
"""

from __future__ import annotations

import pytest
import test_kda_parity as parity  # a module import: pytest would collect imported test functions
import torch
from test_kda_parity import _one_thread  # noqa: F401 (autouse fixture)

from tileport.ops.kda import DISPATCHER, explain_call

ACCEPTED = [cid for cid, c in parity.CASES.items() if c[5] == "bf16" and c[3] == c[4] and c[3] in (64, 128)]


@pytest.mark.parametrize("case_id", ACCEPTED)
def test_forward_backward(case_id, device, seed):
    parity._backend_or_skip("gluon", device)
    parity._run_and_check("gluon", case_id, device, seed)


@pytest.mark.parametrize("case_id,flagged", [("T200-bf16-split-binarybeta", True), ("T65-bf16-l2-near0", False)])
def test_cases_take_both_routes(case_id, flagged, device, seed, monkeypatch):
    """A "split" case sends chunks to Triton's block kernel (stage 3 flags them), a "near0" one
    leaves every chunk to the Gluon kernel: both routes of the backend run in this file's cases."""
    parity._backend_or_skip("gluon", device)
    from tileport.ops.kda import triton_kernels

    seen = []
    real = triton_kernels.output_flagged_chunks
    monkeypatch.setattr(triton_kernels, "output_flagged_chunks",
                        lambda *args: seen.append(bool(args[-1].any())) or real(*args))
    parity._run_and_check("gluon", case_id, device, seed)
    assert seen and any(seen) == flagged, (case_id, seen)


def test_explain_says_why_gluon_refuses():
    refusal = DISPATCHER._by_name["gluon"].refusal
    assert "bfloat16 only" in refusal(explain_call("1,64,1,64,64", torch.float16, "cuda", (9, 0)))
    assert "K == V" in refusal(explain_call("1,64,1,48,80", torch.bfloat16, "cuda", (9, 0)))
    assert "K == V" in refusal(explain_call("1,64,1,64,128", torch.bfloat16, "cuda", (9, 0)))
    assert "Hopper" in refusal(explain_call("1,64,1,64,64", torch.bfloat16, "cuda", (8, 0)))
    assert refusal(explain_call("8,4096,16,128,128", torch.bfloat16, "cuda", (9, 0))) is None
