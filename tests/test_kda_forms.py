"""The KDA Triton forward's alternative forms through the frozen gate (tests/test_kda_parity.py's
cases, forward and backward against the float64 recurrence).

DIAGONAL_FORM = "factored": in stage 3 (GDN's solve kernel, PER_CHANNEL) and the output kernel,
sub-blocks whose gates span at most SPAN_MAX form their diagonal block from reference-row factors
(one tensor-core dot per row block); steeper ones keep the exact form.
The gate's cases cover both: "normal" and "near0" gates take the factored form, "split" and
"verynegative" ones the exact form, "mixed" ones both within one sequence.
"""

from __future__ import annotations

import pytest
from test_kda_parity import CASES, _backend_or_skip, _one_thread, _run_and_check  # noqa: F401 (_one_thread: autouse fixture)

from tileport.ops.kda import triton_kernels as kk


@pytest.mark.parametrize("case_id", list(CASES))
def test_factored_output_diagonal(case_id, device, seed, monkeypatch):
    _backend_or_skip("triton", device)
    monkeypatch.setattr(kk, "DIAGONAL_FORM", "factored")
    _run_and_check("triton", case_id, device, seed)
