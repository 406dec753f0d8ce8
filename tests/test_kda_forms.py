"""The KDA Triton backend's alternative forms through the frozen gate's cases
(tests/test_kda_parity.py), forward and backward, against the float64 recurrence.

DIAGONAL_FORM = "factored": in stage 3 (GDN's solve kernel, PER_CHANNEL) and the output kernel,
and in the backward's dv_local and gated products (`_gated_rows`, `_gated_cols`), 16-row blocks
whose gates span at most SPAN_MAX form their diagonal block from reference-row factors (one
tensor-core dot); steeper ones keep the exact form. The gate's cases cover both: "normal" and
"near0" gates take the factored form, "split" and "verynegative" ones the exact form, "mixed"
ones both within one sequence.
"""

from __future__ import annotations

import pytest
import test_kda_parity as parity  # a module import: pytest would collect imported test functions
from test_kda_parity import CASES, _one_thread  # noqa: F401 (_one_thread: autouse fixture)

from tileport.ops.kda import triton_kernels as kk


@pytest.mark.parametrize("case_id", list(CASES))
def test_factored_diagonal(case_id, device, seed, monkeypatch):
    parity._backend_or_skip("triton", device)
    monkeypatch.setattr(kk, "DIAGONAL_FORM", "factored")
    parity._run_and_check("triton", case_id, device, seed)
