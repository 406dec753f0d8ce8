"""The KDA Triton forward's alternative forms through the frozen gate's cases
(tests/test_kda_parity.py), forward only: the output and final state against the float64
recurrence. (The triton backend's KDA backward recomputes the forward in the DIAGONAL_FORM set,
and test_kda_parity.py checks it in the default form.)

DIAGONAL_FORM = "factored": in stage 3 (GDN's solve kernel, PER_CHANNEL) and the output kernel,
sub-blocks whose gates span at most SPAN_MAX form their diagonal block from reference-row factors
(one tensor-core dot per row block); steeper ones keep the exact form. The gate's cases cover both:
"normal" and "near0" gates take the factored form, "split" and "verynegative" ones the exact
form, "mixed" ones both within one sequence.
"""

from __future__ import annotations

import pytest
import torch
from test_kda_parity import CASES, DTYPES, _backend_or_skip, _one_thread, make_inputs  # noqa: F401 (_one_thread: autouse fixture)

import tileport
from tileport.ops.kda import triton_kernels as kk
from tileport.ops.kda.reference import kda_reference
from tileport.testing import check, poisoned, use_backend


@pytest.mark.parametrize("case_id", list(CASES))
def test_factored_diagonal_forward(case_id, device, seed, monkeypatch):
    _backend_or_skip("triton", device)
    monkeypatch.setattr(kk, "DIAGONAL_FORM", "factored")
    B, T, H, K, V, dt, cu, with_h0, l2, gates, beta_kind, scale = CASES[case_id]
    dtype = DTYPES[dt]
    q, k, v, g, beta, h0, cu_t = make_inputs(B, T, H, K, V, dtype, cu, with_h0, l2, gates, beta_kind, device)
    with torch.no_grad(), poisoned(), use_backend("triton", op="kda"):
        o, ht = tileport.chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=l2, cu_seqlens=cu_t)
        ref_o, ref_ht = kda_reference(q, k, v, g, beta, scale, h0, True, l2, cu_t)
    where = f"[DIAGONAL_FORM=factored case={case_id} seed={seed}]"
    assert o.dtype == dtype and o.shape == (B, T, H, V)
    check(f"o {where}", o, ref_o, dtype)
    check(f"final_state {where}", ht, ref_ht, dtype)
