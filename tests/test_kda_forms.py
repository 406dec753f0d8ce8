"""The KDA Triton backend's alternative forms through the frozen gate's cases
(tests/test_kda_parity.py), forward and backward, against the float64 recurrence.

DIAGONAL_FORM = "factored": in stage 3 (GDN's solve kernel, PER_CHANNEL) and the output kernel,
and in the backward's dv_local and gated products (`_gated_rows`, `_gated_cols`), 16-row blocks
whose gates span at most SPAN_MAX form their diagonal block from reference-row factors (one
tensor-core dot); steeper ones keep the exact form. The gate's cases cover both: "normal" and
"near0" gates take the factored form, "split" and "verynegative" ones the exact form, "mixed"
ones both within one sequence.

DIAGONAL_FORM = "chunk" (the forward of 16-bit inputs): stage 3 and the output kernel take a chunk
whose gates span at most 60 about its middle row as one whole-chunk product of factors (GDN's tile
solve with PER_CHANNEL), the others as "factored"; the backward as "factored". The same cases cover
both kinds of chunk: "normal" and "near0" whole, "split" and "verynegative" by blocks, "mixed" both.
"""

from __future__ import annotations

import pytest
import test_kda_parity as parity  # a module import: pytest would collect imported test functions
from test_kda_parity import CASES, _one_thread  # noqa: F401 (_one_thread: autouse fixture)

from tileport.ops.gdn import triton_kernels as gdn_kernels
from tileport.ops.kda import triton_kernels as kk


@pytest.mark.parametrize("case_id", list(CASES))
def test_factored_diagonal(case_id, device, seed, monkeypatch):
    parity._backend_or_skip("triton", device)
    monkeypatch.setattr(kk, "DIAGONAL_FORM", "factored")
    parity._run_and_check("triton", case_id, device, seed)


@pytest.mark.parametrize("case_id", list(CASES))
def test_chunk_diagonal(case_id, device, seed, monkeypatch):
    parity._backend_or_skip("triton", device)
    monkeypatch.setattr(kk, "DIAGONAL_FORM", "chunk")
    parity._run_and_check("triton", case_id, device, seed)


@pytest.mark.parametrize("case_id", list(CASES))
@pytest.mark.parametrize("whole", [True, False], ids=["backward-whole", "backward-blocks"])
def test_chunk_backward_forms(case_id, whole, device, seed, monkeypatch):
    """DIAGONAL_FORM "chunk" with the backward in whole chunks too (BACKWARD_WHOLE_CHUNKS, the
    default: the recompute's stage 3, 7, 9b and 10b on the recompute's flags) and without (every
    chunk of the backward in 16-row blocks), whichever is the default."""
    parity._backend_or_skip("triton", device)
    monkeypatch.setattr(kk, "DIAGONAL_FORM", "chunk")
    monkeypatch.setattr(kk, "BACKWARD_WHOLE_CHUNKS", whole)
    parity._run_and_check("triton", case_id, device, seed)


@pytest.mark.parametrize("case_id", list(CASES))
def test_chunk_cumsum_in_stage3(case_id, device, seed, monkeypatch):
    """DIAGONAL_FORM "chunk" with the gate sums G formed by stage 3's tile kernel from g
    (CUMSUM_FORM "stage-3"), in the forward and the backward's recompute."""
    parity._backend_or_skip("triton", device)
    monkeypatch.setattr(kk, "DIAGONAL_FORM", "chunk")
    monkeypatch.setattr(kk, "CUMSUM_FORM", "stage-3")
    parity._run_and_check("triton", case_id, device, seed)


@pytest.mark.parametrize("case_id", list(CASES))
def test_gate_sums_in_fp32(case_id, device, seed, monkeypatch):
    """The gate sums G stored in fp32 for 16-bit inputs (GATE_SUMS_16BIT "fp32"; fp32 inputs keep
    fp64), in the default forms otherwise, forward and backward, at the gate's tolerances."""
    parity._backend_or_skip("triton", device)
    monkeypatch.setattr(kk, "GATE_SUMS_16BIT", "fp32")
    parity._run_and_check("triton", case_id, device, seed)


# KDA's dqkwg takes its block of key columns from GDN's switch (DQKWG_KEY_BLOCK, `_key_split`):
# the gate's cases with K > 32 in the other block.
OTHER_DQKWG_KEY_BLOCK = {64: 32, 32: 64}[gdn_kernels.DQKWG_KEY_BLOCK]


@pytest.mark.parametrize("case_id", [c for c in CASES if CASES[c][3] > 32])
def test_other_dqkwg_key_block(case_id, device, seed, monkeypatch):
    parity._backend_or_skip("triton", device)
    monkeypatch.setattr(gdn_kernels, "DQKWG_KEY_BLOCK", OTHER_DQKWG_KEY_BLOCK)
    parity._run_and_check("triton", case_id, device, seed)
