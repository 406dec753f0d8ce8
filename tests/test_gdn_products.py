"""The backward's product precision switches of the GDN Triton kernels (`_products`): what each
stage is handed, so a measurement that sets one stage apart (BACKWARD_PRODUCTS_BY_STAGE) changes
that stage alone. The gate itself runs the forms (tests/test_gdn_tuning.py)."""

import pytest
import torch

from tileport.ops.gdn import triton_kernels as tk

STAGES = ("keys", "states", "dv_local", "dstates", "dqkwg", "wy_bwd")


@pytest.mark.parametrize("form", ["tf32", "bf16x3"])
def test_backward_products_for_16_bit_inputs(form, monkeypatch):
    monkeypatch.setattr(tk, "BACKWARD_PRODUCTS", form)
    for dtype in (torch.bfloat16, torch.float16):
        prec = tk._products(dtype, True)[2]
        assert prec in (form, form + "-emulated")
        assert tk._products(dtype, False)[2] == "ieee"  # the forward rounds its operands instead
    assert tk._products(torch.float32, True)[2] == "ieee"  # fp32 inputs: exact fp32 products


def test_one_stage_set_apart(monkeypatch):
    monkeypatch.setattr(tk, "BACKWARD_PRODUCTS", "tf32")
    monkeypatch.setattr(tk, "BACKWARD_PRODUCTS_BY_STAGE", {"dv_local": "bf16"})
    for stage in STAGES:
        prec = tk._products(torch.bfloat16, True, stage)[2]
        assert (prec == "ieee") if stage == "dv_local" else prec.startswith("tf32"), (stage, prec)


def test_unknown_forms_and_stages_refused(monkeypatch):
    monkeypatch.setattr(tk, "BACKWARD_PRODUCTS_BY_STAGE", {"wy_bwd": "tf32x3"})  # not a backward form
    with pytest.raises(ValueError, match="BACKWARD_PRODUCTS"):
        tk._products(torch.bfloat16, True, "wy_bwd")
    monkeypatch.setattr(tk, "BACKWARD_PRODUCTS_BY_STAGE", {"wy_bw": "bf16"})  # a misspelt stage
    with pytest.raises(ValueError, match="stages"):
        tk._products(torch.bfloat16, True, "dqkwg")


# The emulated precisions are what make the CPU gate test the GPU's rounding: a product formed
# through them must differ from the exact one by the rounding, and match the rounding done in torch.
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tileport.dispatch import interpreter_enabled  # noqa: E402
from tileport.ops.gdn.triton_kernels import _mm, _tile_dot  # noqa: E402


@triton.jit
def _product_probe(a_ptr, b_ptr, o_ptr, N: tl.constexpr, PREC: tl.constexpr, TILE: tl.constexpr,
                   DT: tl.constexpr, DA: tl.constexpr):
    r = tl.arange(0, N)
    a = tl.load(a_ptr + r[:, None] * N + r[None, :])
    b = tl.load(b_ptr + r[:, None] * N + r[None, :])
    if TILE:
        o = _tile_dot(a, b, PREC, DT, DA)
    else:
        o = _mm(a, b, PREC, DT, DA)
    tl.store(o_ptr + r[:, None] * N + r[None, :], o)


def _tf32_truncated(x):
    return (x.view(torch.int32) & -8192).view(torch.float32)


@pytest.mark.parametrize("prec,tile", [("tf32-emulated", False), ("tf32-emulated", True), ("bf16", True)])
def test_emulated_products_round_as_the_tensor_cores(prec, tile):
    if not interpreter_enabled():
        pytest.skip("the emulated forms are the interpreter's (TRITON_INTERPRET=1)")
    N = 16
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(N, N, generator=g), torch.randn(N, N, generator=g)
    o = torch.empty(N, N)
    DT, DA = tk._dot_types(torch.bfloat16)
    _product_probe[(1,)](a, b, o, N, prec, tile, DT, DA)
    if prec == "bf16":
        rounded = a.bfloat16().double() @ b.bfloat16().double()
    else:
        rounded = _tf32_truncated(a).double() @ _tf32_truncated(b).double()
    exact = a.double() @ b.double()
    rel = lambda x, y: ((x.double() - y).norm() / y.norm()).item()  # noqa: E731
    assert rel(o, rounded) < 1e-6, "not the rounding the tensor cores do"
    assert rel(o, exact) > 1e-5, "no rounding at all: the CPU gate would test exact products"
