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


@pytest.mark.parametrize("kernel", ["triton", "gluon"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stage8_widens_bf16_w(layout, kernel, device, seed):
    """The backward's W in bf16 (BACKWARD_W_DTYPE "bf16"): stage 8 (Triton's `chunk_dstates`; on
    the GPU also the Gluon recurrence) given it computes bitwise what it computes from an fp32 W
    holding the same values (it widens W where it loads it)."""
    from tileport.ops.gdn import gluon_kernels as gdn_gluon
    from tileport.ops.gdn import triton_kernels as gdn_triton

    parity._backend_or_skip(kernel, device)
    fn = gdn_triton.chunk_dstates if kernel == "triton" else gdn_gluon.chunk_dstates_gluon
    args, kwargs = capture_stage("dstates", layout, 64, True, device)
    w16 = args[2].to(torch.bfloat16)
    assert not torch.equal(w16.float(), args[2]), "the draw's W holds bf16 values already"
    outs = []
    for w in (w16, w16.float()):
        with poisoned():
            outs.append(fn(*args[:2], w, *args[3:], **kwargs))
    for name, a, b in zip(("dh", "dVn", "d initial_state"), *outs):
        assert torch.equal(a, b), f"{name} [{kernel} {layout}]: bf16 W != the same values in fp32"


def test_gluon_stage8_rule_takes_bf16_w(monkeypatch):
    """GDN's rule for its Gluon recurrences takes KDA's W in bf16 for stage 8 (per-channel gates),
    with fp32 or bf16 keys, and nowhere else: not for stage 5's recompute, not with per-head gates
    (GDN's own), not in fp16."""
    from standins import OnGPU

    from tileport.ops.gdn import gluon_kernels as gdn_gluon

    f32, bf, f16 = OnGPU(torch.float32, 3), OnGPU(torch.bfloat16, 3), OnGPU(torch.float16, 3)
    g = OnGPU(torch.float32, 3)
    monkeypatch.setattr(gdn_gluon, "BACKWARD_STATES", "gluon")
    monkeypatch.setattr(gdn_gluon, "DSTATES_16BIT_KEYS", True)
    assert gdn_gluon.recurrence_kernel_for("dstates", (f32, f32, bf), g, torch.bfloat16) == "gluon"
    assert gdn_gluon.recurrence_kernel_for("dstates", (bf, bf, bf), g, torch.bfloat16) == "gluon"
    assert gdn_gluon.recurrence_kernel_for("dstates", (f32, f32, f16), g, torch.bfloat16) == "triton"
    assert gdn_gluon.recurrence_kernel_for("states", (f32, bf, f32), g, torch.bfloat16) == "triton"
    assert gdn_gluon.recurrence_kernel_for("dstates", (f32, f32, bf), OnGPU(torch.float64, 2), torch.bfloat16) == "triton"


def test_w_dtype_is_checked(device, monkeypatch):
    """BACKWARD_W_DTYPE other than "fp32" and "bf16", and chunk_wu_from_t_kda's w_dtype other than
    fp32 and bf16, are refused by name."""
    from tileport.ops.kda import triton_kernels as kk

    parity._backend_or_skip("triton", device)
    with pytest.raises(ValueError, match="w_dtype must be torch.float32 or torch.bfloat16"):
        x = torch.zeros(1, 1, 1)
        kk.chunk_wu_from_t_kda(x, x, x, x, x, None, None, torch.bfloat16, False, w_dtype=torch.float16)
    monkeypatch.setattr(kk, "BACKWARD_W_DTYPE", "fp16")
    q, k, v, g, beta, h0, cu = parity.make_inputs(1, 8, 1, 16, 16, torch.bfloat16, None, False, False, "normal",
                                                  "rand", device)
    for t in (q, k, v, g, beta):
        t.requires_grad_(True)
    with pytest.raises(ValueError, match="BACKWARD_W_DTYPE"):
        import tileport
        from tileport.dispatch import use_backend

        with use_backend("triton", op="kda"):
            o, _ = tileport.chunk_kda(q, k, v, g, beta)
            o.sum().backward()
