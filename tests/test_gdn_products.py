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
