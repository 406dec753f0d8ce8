"""The KDA Triton backend's alternative forms through the frozen gate's cases
(tests/test_kda_parity.py), forward and backward, against the float64 recurrence.

DIAGONAL_FORM = "factored": in stage 3 (GDN's solve kernel, PER_CHANNEL) and the output kernel,
and in the backward's dv_local and gated products (`_gated_rows`, `_gated_cols`), 16-row blocks
whose gates span at most SPAN_MAX form their diagonal block from reference-row factors (one
tensor-core dot); steeper ones keep the exact form. The gate's cases cover both: "normal" and
"near0" gates take the factored form, "split" and "verynegative" ones the exact form, "mixed"
ones both within one sequence.

DIAGONAL_FORM = "chunk" (16-bit inputs, the default): stage 3 and the output kernel take a chunk
whose gates span at most 60 about its middle row as one whole-chunk product of factors (GDN's tile
solve with PER_CHANNEL), the others as "factored"; the backward likewise (BACKWARD_WHOLE_CHUNKS) or
by "factored" blocks throughout. The same cases cover both kinds of chunk: "normal" and "near0"
whole, "split" and "verynegative" by blocks, "mixed" both.
"""

from __future__ import annotations

import pytest
import test_kda_parity as parity  # a module import: pytest would collect imported test functions
import torch
from kda_stage_cases import LAYOUTS, normwise, route_rows
from test_kda_parity import CASES, _one_thread  # noqa: F401 (_one_thread: autouse fixture)

from tileport.ops.gdn import triton_kernels as gdn_kernels
from tileport.ops.kda import triton_kernels as kk


# Each form as the module switches that make it (the rest at their defaults): the default forms
# (DIAGONAL_FORM "chunk", whole-chunk backward, G formed in stage 3 and stored in fp32 for 16-bit
# inputs) run in tests/test_kda_parity.py; these are the alternatives kept beside them.
FORMS = {
    "factored": dict(DIAGONAL_FORM="factored"),
    # the chunk forward with every chunk of the backward in 16-row blocks (BACKWARD_WHOLE_CHUNKS off)
    "chunk-backward-blocks": dict(BACKWARD_WHOLE_CHUNKS=False),
    # stage 2 formed by its own kernel (before the fourteenth session's default, stage 3's tile)
    "cumsum-in-stage2": dict(CUMSUM_FORM="stage-2"),
    # G stored in fp64 for 16-bit inputs too (the default before the fourteenth session)
    "gate-sums-fp64": dict(GATE_SUMS_16BIT="fp64"),
    # 9b's and 10b's whole-chunk routes as their own launches (before the fifteenth session)
    "pairs-unfused": dict(BACKWARD_FUSED_PAIRS=()),
    # stage 7's whole chunks in blocks of 64 value columns (before the fifteenth session)
    "dv-local-whole-bv64": dict(DV_LOCAL_WHOLE_BV=64),
    # the backward recomputes stage 3 (G, T, W, U) rather than taking its forward's G and T
    # (before the sixteenth session)
    "recompute-stage3": dict(KEEP_FORWARD_TILES=False),
    # the backward's l2-normalised q and k in fp32 rather than the inputs' dtype (before the thirtieth
    # session; stage 7's whole chunks then read the raw keys and normalise them: DV_LOCAL_RAW_QK)
    "bwd-qk-fp32": dict(BACKWARD_NORMALISED_QK="fp32"),
    # the backward's flagged chunks' launches on grids of every chunk rather than over their
    # worklist (before the twenty-fifth session)
    "bwd-flagged-grid": dict(BACKWARD_FLAGGED_WORKLIST=False),
    # with fp32 normalised q and k, stage 7's whole chunks from l2norm_fwd's fp32 copies rather than
    # the raw q and k normalised where loaded (DV_LOCAL_RAW_QK; before the twenty-seventh session)
    "dv-local-fp32-qk": dict(BACKWARD_NORMALISED_QK="fp32", DV_LOCAL_RAW_QK=False),
    # stage 8's dh and dVn stored in bf16 for 16-bit inputs, widened by stages 9 and 10 where read
    # (BACKWARD_DSTATES_DTYPE "bf16", off: docs/perf/kda.md row 49)
    "bwd-dstates-bf16": dict(BACKWARD_DSTATES_DTYPE="bf16"),
    # the backward's W (from the kept T) stored in bf16 for 16-bit inputs, widened by stages 8 and 10
    # (BACKWARD_W_DTYPE "bf16", off: docs/perf/kda.md row 50)
    "bwd-w-bf16": dict(BACKWARD_W_DTYPE="bf16"),
}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("case_id", list(CASES))
def test_form(case_id, form, device, seed, monkeypatch):
    parity._backend_or_skip("triton", device)
    for name, value in FORMS[form].items():
        monkeypatch.setattr(kk, name, value)
    parity._run_and_check("triton", case_id, device, seed)


# KDA's dqkwg takes its block of key columns from GDN's switch (DQKWG_KEY_BLOCK, `_key_split`):
# the gate's cases with K > 32 in the other block.
OTHER_DQKWG_KEY_BLOCK = {64: 32, 32: 64}[gdn_kernels.DQKWG_KEY_BLOCK]


@pytest.mark.parametrize("case_id", [c for c in CASES if CASES[c][3] > 32])
def test_other_dqkwg_key_block(case_id, device, seed, monkeypatch):
    parity._backend_or_skip("triton", device)
    monkeypatch.setattr(gdn_kernels, "DQKWG_KEY_BLOCK", OTHER_DQKWG_KEY_BLOCK)
    parity._run_and_check("triton", case_id, device, seed)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dv_local_whole_chunks_from_raw_keys(layout, device, seed, monkeypatch):
    """DV_LOCAL_RAW_QK: with the backward's normalised q and k in fp32 (BACKWARD_NORMALISED_QK "fp32";
    with bf16 ones stage 7 reads those, and the switch has nothing to do), stage 7's whole-chunk
    launch reads the raw bf16 q and k and normalises each row itself in fp32 (the switch's default);
    against the same launch on `l2norm_fwd`'s fp32 copies, dVl of
    the unflagged chunks within 1e-4 normwise, the flagged chunks' rows (normalised copies either
    way) bitwise equal. The same formula, but the row sums may run in another order on the GPU, and
    a last-bit difference in a normalised value can flip the bf16 rounding of a product operand
    (2^-8 relative, rarely): hence 1e-4, not bitwise. Rows left unnormalised are off by their norms
    (6.97 normwise when the keys were not normalised). CPU interpreter: 0, bitwise."""
    parity._backend_or_skip("triton", device)
    cu, B, T, (lo, hi) = LAYOUTS[layout]
    K = 64
    q, k, v, g, beta, h0, cu_t = parity.make_inputs(B, T, 2, K, K, torch.bfloat16, cu, True, True, "normal", "rand",
                                                    device)
    g[0, lo:hi, 0] = -20.0 - 10.0 * torch.rand(hi - lo, K, device=device)  # one chunk flagged
    captured = []
    real = kk.chunk_dv_local_kda
    monkeypatch.setattr(kk, "chunk_dv_local_kda", lambda *a, **kw: captured.append((a, kw)) or real(*a, **kw))
    monkeypatch.setattr(kk, "DV_LOCAL_RAW_QK", True)
    monkeypatch.setattr(kk, "BACKWARD_NORMALISED_QK", "fp32")
    kk.kda_backward_triton(torch.randn_like(v), None, q, k, v, g, beta, K ** -0.5, h0, True, cu_t)
    (args, kwargs), = captured
    assert kwargs["raw_qk"] is not None, "the switch hands stage 7 the raw q and k"
    raw_q, raw_k = kwargs["raw_qk"]
    assert raw_q.dtype == torch.bfloat16 and args[0].dtype == torch.float32
    got = real(*args, **kwargs)
    base = real(*args, **dict(kwargs, raw_qk=None))
    unflagged, flagged = route_rows(args[5], kwargs["span_flags"])
    unflagged, flagged = unflagged.to(got.device), flagged.to(got.device)
    assert unflagged.any() and flagged.any(), "both routes run"
    assert not got.isnan().any()
    err = normwise(got[unflagged], base[unflagged])
    print(f"dv-local raw q, k [{layout}]: {err:.2e}")
    assert err <= 1e-4, f"dVl of the whole chunks [{layout}]: {err:.2e} normwise from the fp32 copies' launch"
    assert torch.equal(got[flagged], base[flagged]), f"dVl of the flagged chunks [{layout}]"
