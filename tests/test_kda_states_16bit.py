"""KDA's backward states in 16 bits (docs/perf/kda.md rows 48 and 49): stage 8 storing dh and dVn
in bf16 (triton_kernels.BACKWARD_DSTATES_DTYPE "bf16") stores its fp32 values rounded and nothing
else moves; the readers' widening is tested beside them (tests/test_kda_gluon_stage9.py,
test_kda_gluon_wy.py) and the whole backward through the gate (tests/test_kda_forms.py
"bwd-dstates-bf16" on the CPU, test_kda_gluon_states.py's gate forms on the GPU)."""

from __future__ import annotations

import pytest
import test_kda_parity as parity  # a module import: pytest would collect imported test functions
import torch
from kda_stage_cases import LAYOUTS, capture_stage, rounded_as_kernels_round
from test_kda_parity import _one_thread  # noqa: F401 (autouse fixture)

from tileport.testing import poisoned


@pytest.mark.parametrize("kernel", ["triton", "gluon"])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stage8_stores_its_states_rounded(layout, K, kernel, device, seed):
    """Stage 8 (Triton's `chunk_dstates`; on the GPU also the Gluon recurrence through
    `chunk_dstates_gluon`) with states_dtype bf16: dh and dVn are its fp32 ones rounded to nearest
    even (the recurrence carries fp32 either way), d initial_state bitwise unchanged; every buffer
    NaN-poisoned. Arguments captured from a real backward (bf16 inputs, l2norm, an initial state)."""
    from tileport.ops.gdn import gluon_kernels as gdn_gluon
    from tileport.ops.gdn import triton_kernels as gdn_triton

    parity._backend_or_skip(kernel, device)
    fn = gdn_triton.chunk_dstates if kernel == "triton" else gdn_gluon.chunk_dstates_gluon
    args, kwargs = capture_stage("dstates", layout, K, True, device)
    assert kwargs.get("states_dtype", torch.float32) == torch.float32, "the default backward keeps fp32 states"
    got = {}
    for dtype in (torch.float32, torch.bfloat16):
        with poisoned():
            got[dtype] = fn(*args, **dict(kwargs, states_dtype=dtype))
    (dh32, dvn32, dh0_32), (dh16, dvn16, dh0_16) = got[torch.float32], got[torch.bfloat16]
    where = f"[{kernel} {layout} K={K}]"
    assert dh16.dtype == dvn16.dtype == torch.bfloat16 and dh0_16.dtype == torch.float32, where
    assert rounded_as_kernels_round(dh16, dh32), f"dh {where}: not the fp32 dh rounded"
    assert rounded_as_kernels_round(dvn16, dvn32), f"dVn {where}: not the fp32 dVn rounded"
    assert torch.equal(dh0_16, dh0_32), f"d initial_state {where} moved"


def test_states_dtype_is_checked():
    """states_dtype other than fp32 and bf16 is refused by name, before any launch."""
    from tileport.ops.gdn import gluon_kernels as gdn_gluon
    from tileport.ops.gdn import triton_kernels as gdn_triton

    x = torch.zeros(1)
    for fn in (gdn_triton.chunk_dstates, gdn_gluon.chunk_dstates_gluon):
        with pytest.raises(ValueError, match="states_dtype must be torch.float32 or torch.bfloat16"):
            fn(x.view(1, 1, 1), x, x, x, x.view(1, 1, 1), x, None, 1.0, None, False, states_dtype=torch.float16)


def test_backward_switch_is_checked(device, monkeypatch):
    """BACKWARD_DSTATES_DTYPE other than "fp32" and "bf16" is refused by name."""
    from tileport.ops.kda import triton_kernels as kk

    parity._backend_or_skip("triton", device)
    monkeypatch.setattr(kk, "BACKWARD_DSTATES_DTYPE", "fp16")
    q, k, v, g, beta, h0, cu = parity.make_inputs(1, 8, 1, 16, 16, torch.bfloat16, None, False, False, "normal",
                                                  "rand", device)
    with pytest.raises(ValueError, match="BACKWARD_DSTATES_DTYPE"):
        kk.kda_backward_triton(torch.randn_like(v), None, q, k, v, g, beta, 0.25, None, False, cu)
