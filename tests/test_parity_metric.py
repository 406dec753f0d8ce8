"""The parity gate's metric itself (tileport.testing.check): the bounds it applies, and the one
case rel cannot judge, a reference wholly below the output dtype's smallest normal."""

from __future__ import annotations

import pytest
import torch

from tileport.testing import GATE, OUTPUT, ParityError, check


def test_rel_bound_per_dtype_and_kind():
    ref = torch.randn(1000, dtype=torch.float64)
    noise = torch.randn(1000, dtype=torch.float64)
    noise *= ref.norm() / noise.norm()
    check("ok", (ref + 0.9e-2 * noise).float(), ref, torch.bfloat16, OUTPUT)
    with pytest.raises(ParityError):
        check("output", (ref + 1.1e-2 * noise).float(), ref, torch.bfloat16, OUTPUT)
    check("gate", (ref + 2.9e-2 * noise).float(), ref, torch.bfloat16, GATE)
    with pytest.raises(ParityError):
        check("fp32", (ref + 2e-5 * noise).float(), ref, torch.float32, OUTPUT)


def test_nan_never_passes():
    ref = torch.randn(64, dtype=torch.float64)
    out = ref.float().clone()
    out[3] = float("nan")
    with pytest.raises(ParityError, match="non-finite"):
        check("nan", out, ref, torch.bfloat16, GATE)


def test_reference_below_the_smallest_normal():
    # A KDA final state after a run of beta = 0 steps under gates of -50..-1000: ~1e-54, which
    # no fp32 output can hold (rel would be 1 for the float64 reference itself, cast to fp32).
    ref = 1e-54 * torch.randn(64, 64, dtype=torch.float64)
    check("underflowed", torch.zeros(64, 64), ref, torch.bfloat16)
    check("subnormal", torch.full((64, 64), 1e-40), ref, torch.bfloat16)
    with pytest.raises(ParityError, match="smallest normal"):
        out = torch.zeros(64, 64)
        out[5, 7] = 1e-3  # one element the kernel should not have produced
        check("stray", out, ref, torch.bfloat16)
    with pytest.raises(ParityError, match="smallest normal"):
        out = torch.zeros(64, 64)
        out[0, 0] = float("nan")
        check("nan", out, ref, torch.bfloat16)
    # one element in the normal range and rel judges alone: zeros are then wrong
    ref[0, 0] = 1.0
    with pytest.raises(ParityError, match="rel error"):
        check("normal", torch.zeros(64, 64), ref, torch.bfloat16)


def test_zero_reference_keeps_the_absolute_rule():
    ref = torch.zeros(16, dtype=torch.float64)
    check("zeros", torch.full((16,), 1e-6), ref, torch.bfloat16)
    with pytest.raises(ParityError):
        check("zeros", torch.full((16,), 1.0), ref, torch.bfloat16)
