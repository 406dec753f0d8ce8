"""The chunked KDA backward algebra (tests/kda_chunk_algebra.py, float64) against the reference's
reverse sweep: the derivation the Triton backward's stages implement, checked on its own so that a
failing kernel stage can be told from a wrong formula."""

from __future__ import annotations

import pytest
import torch
from kda_chunk_algebra import chunked_backward
from test_kda_parity import CASES, DTYPES, make_inputs

from tileport.ops.kda.reference import recurrent_backward


@pytest.mark.parametrize("wu_free", [False, True], ids=["w-u", "from-t"])
@pytest.mark.parametrize("case_id", ["T65-bf16-l2-near0", "T200-bf16-split-binarybeta", "varlen-bf16-l2-mixed",
                                     "K48-V80-fp32-mixed", "T100-fp16-verynegative"])
def test_chunked_backward_matches_the_reverse_sweep(case_id, wu_free, seed):
    """wu_free: the backward's loop without W and U (T and the inputs instead; the identities of
    kda.md's "Plan: the backward without W and U")."""
    B, T, H, K, V, dt, cu, with_h0, l2, gates, beta_kind, scale = CASES[case_id]
    q, k, v, g, beta, h0, cu_t = make_inputs(B, T, H, K, V, DTYPES[dt], cu, with_h0, l2, gates, beta_kind, "cpu")
    scale = scale or K ** -0.5
    N = B if cu is None else len(cu) - 1
    do = torch.randn(B, T, H, V, dtype=torch.float64)
    dht = torch.randn(N, H, K, V, dtype=torch.float64)
    got = chunked_backward(do, dht, q, k, v, g, beta, scale, h0, l2, cu_t, wu_free=wu_free)
    want = recurrent_backward(do, dht, q, k, v, g, beta, scale, h0, l2, cu_t)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        if b is None:
            assert a is None, name
            continue
        err = ((a - b).norm() / b.norm()).item()
        assert err < 1e-10, f"{name}: {err:.2e} [{case_id} wu_free={wu_free} seed={seed}]"
