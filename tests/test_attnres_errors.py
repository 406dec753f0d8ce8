"""Bad input to fused_attnres: a clear ValueError/TypeError naming the argument, never a crash."""

import pytest
import torch

import tileport

D = 32


def good():
    return dict(
        query=torch.randn(D),
        residuals=[torch.randn(4, D) for _ in range(3)],
        rms_weight=torch.rand(D) + 0.5,
    )


def call(**over):
    args = good()
    args.update(over)
    return tileport.fused_attnres(**args)


CASES = [
    ("empty residuals", dict(residuals=[]), ValueError, "residuals"),
    ("residuals not a sequence", dict(residuals=torch.randn(3, 4, D)), TypeError, "residuals"),
    ("residual not a tensor", dict(residuals=[torch.randn(4, D), "x"]), TypeError, r"residuals\[1\]"),
    ("mismatched shapes", dict(residuals=[torch.randn(4, D), torch.randn(5, D)]), ValueError, r"residuals\[1\].*shape"),
    ("mismatched D", dict(residuals=[torch.randn(4, D), torch.randn(4, D + 1)]), ValueError, r"residuals\[1\]"),
    ("mismatched dtypes", dict(residuals=[torch.randn(4, D), torch.randn(4, D).bfloat16()]), TypeError, r"residuals\[1\].*dtype"),
    ("integer residuals", dict(residuals=[torch.ones(4, D, dtype=torch.int32)]), TypeError, r"residuals\[0\]"),
    ("0-d residual", dict(residuals=[torch.tensor(1.0)]), ValueError, r"residuals\[0\]"),
    ("query wrong size", dict(query=torch.randn(D + 1)), ValueError, "query"),
    ("query wrong rank", dict(query=torch.randn(2, D)), ValueError, "query"),
    ("integer query", dict(query=torch.ones(D, dtype=torch.int64)), TypeError, "query"),
    ("query not a tensor", dict(query=[1.0] * D), TypeError, "query"),
    ("rms_weight wrong size", dict(rms_weight=torch.rand(D - 1)), ValueError, "rms_weight"),
    ("integer rms_weight", dict(rms_weight=torch.ones(D, dtype=torch.int32)), TypeError, "rms_weight"),
    ("output_rms_weight wrong size", dict(output_rms_weight=torch.rand(2 * D)), ValueError, "output_rms_weight"),
    ("bad eps", dict(rms_eps=0.0), ValueError, "rms_eps"),
    ("nan eps", dict(rms_eps=float("nan")), ValueError, "rms_eps"),
    ("inf scale", dict(scale=float("inf")), ValueError, "scale"),
    ("return_weights not bool", dict(return_weights=1), TypeError, "return_weights"),
    ("bad checkpoint level", dict(checkpoint_level=2), ValueError, "checkpoint_level"),
]


@pytest.mark.parametrize("what,over,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_naming_the_argument(what, over, exc, match):
    with pytest.raises(exc, match=match):
        call(**over)


def test_mixed_devices_named():
    # A meta tensor stands in for "another device" on a CPU-only machine.
    with pytest.raises(ValueError, match="query"):
        call(query=torch.randn(D, device="meta"))
    with pytest.raises(ValueError, match=r"residuals\[1\]"):
        call(residuals=[torch.randn(4, D), torch.randn(4, D, device="meta")])


def test_good_call_passes():
    assert call().shape == (4, D)
