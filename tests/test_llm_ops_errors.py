"""Bad input to rms_norm, rope, swiglu, softmax and grouped_gemm: a clear ValueError/TypeError naming the
argument, never a crash or a silent wrong result."""

import pytest
import torch

import tileport

D = 32


def _rms(**over):
    args = dict(x=torch.randn(4, D), weight=torch.rand(D) + 0.5, eps=1e-6)
    args.update(over)
    return tileport.rms_norm(**args)


def _rope(**over):
    args = dict(x=torch.randn(2, 5, 3, D), cos=torch.randn(5, D), sin=torch.randn(5, D))
    args.update(over)
    return tileport.rope(**args)


def _swiglu(**over):
    args = dict(x=torch.randn(4, D), y=torch.randn(4, D))
    args.update(over)
    return tileport.swiglu(**args)


def _softmax(**over):
    args = dict(x=torch.randn(4, D))
    args.update(over)
    return tileport.softmax(**args)


def _gg(**over):
    args = dict(a=[torch.randn(3, D), torch.randn(0, D)], b=[torch.randn(D, 8), torch.randn(D, 8)])
    args.update(over)
    return tileport.grouped_gemm(**args)


CASES = [
    # rms_norm
    ("rms x not a tensor", _rms, dict(x=[1.0] * D), TypeError, "x"),
    ("rms integer x", _rms, dict(x=torch.ones(4, D, dtype=torch.int32)), TypeError, "x"),
    ("rms 0-d x", _rms, dict(x=torch.tensor(1.0), weight=None), ValueError, "x"),
    ("rms D = 0", _rms, dict(x=torch.randn(4, 0), weight=None), ValueError, "x"),
    ("rms weight wrong size", _rms, dict(weight=torch.rand(D + 1)), ValueError, "weight"),
    ("rms weight wrong rank", _rms, dict(weight=torch.rand(1, D)), ValueError, "weight"),
    ("rms integer weight", _rms, dict(weight=torch.ones(D, dtype=torch.int64)), TypeError, "weight"),
    ("rms weight not a tensor", _rms, dict(weight=[1.0] * D), TypeError, "weight"),
    ("rms zero eps", _rms, dict(eps=0.0), ValueError, "eps"),
    ("rms nan eps", _rms, dict(eps=float("nan")), ValueError, "eps"),
    ("rms bool eps", _rms, dict(eps=True), ValueError, "eps"),
    # rope
    ("rope x not a tensor", _rope, dict(x="x"), TypeError, "x"),
    ("rope x rank 3", _rope, dict(x=torch.randn(5, 3, D)), ValueError, "x"),
    ("rope odd D", _rope, dict(x=torch.randn(2, 5, 3, 7), cos=torch.randn(5, 7), sin=torch.randn(5, 7)), ValueError, "D"),
    ("rope integer x", _rope, dict(x=torch.ones(2, 5, 3, D, dtype=torch.int16)), TypeError, "x"),
    ("rope cos wrong T", _rope, dict(cos=torch.randn(6, D)), ValueError, "cos"),
    ("rope cos wrong D", _rope, dict(cos=torch.randn(5, D // 2)), ValueError, "cos"),
    ("rope cos broadcast shape", _rope, dict(cos=torch.randn(1, 5, 1, D)), ValueError, "cos"),
    ("rope sin wrong shape", _rope, dict(sin=torch.randn(5, D + 2)), ValueError, "sin"),
    ("rope integer sin", _rope, dict(sin=torch.ones(5, D, dtype=torch.int32)), TypeError, "sin"),
    ("rope cos requires grad", _rope, dict(cos=torch.randn(5, D, requires_grad=True)), ValueError, "cos"),
    # swiglu
    ("swiglu x not a tensor", _swiglu, dict(x=3.0), TypeError, "x"),
    ("swiglu y not a tensor", _swiglu, dict(y=None), TypeError, "y"),
    ("swiglu shape mismatch", _swiglu, dict(y=torch.randn(4, D + 1)), ValueError, "y"),
    ("swiglu no broadcasting", _swiglu, dict(y=torch.randn(D)), ValueError, "y"),
    ("swiglu dtype mismatch", _swiglu, dict(y=torch.randn(4, D).bfloat16()), TypeError, "y"),
    ("swiglu integer x", _swiglu, dict(x=torch.ones(4, D, dtype=torch.int32)), TypeError, "x"),
    # softmax
    ("softmax x not a tensor", _softmax, dict(x=[0.0, 1.0]), TypeError, "x"),
    ("softmax integer x", _softmax, dict(x=torch.ones(4, D, dtype=torch.int64)), TypeError, "x"),
    ("softmax 0-d x", _softmax, dict(x=torch.tensor(2.0)), ValueError, "x"),
    ("softmax D = 0", _softmax, dict(x=torch.randn(4, 0)), ValueError, "x"),
    ("softmax dim not last", _softmax, dict(dim=0), ValueError, "dim"),
    ("softmax dim out of range", _softmax, dict(dim=5), ValueError, "dim"),
    ("softmax dim not an int", _softmax, dict(dim=1.0), TypeError, "dim"),
    # grouped_gemm
    ("gg a not a sequence", _gg, dict(a=torch.randn(2, 3, D)), TypeError, "a"),
    ("gg empty a", _gg, dict(a=[], b=[]), ValueError, "a"),
    ("gg a[0] rank 3", _gg, dict(a=[torch.randn(1, 3, D), torch.randn(2, D)]), ValueError, r"a\[0\]"),
    ("gg a[1] wrong K", _gg, dict(a=[torch.randn(3, D), torch.randn(2, D + 1)]), ValueError, r"a\[1\]"),
    ("gg a[1] dtype", _gg, dict(a=[torch.randn(3, D), torch.randn(2, D).half()]), TypeError, r"a\[1\]"),
    ("gg integer a", _gg, dict(a=[torch.ones(3, D, dtype=torch.int32)] * 2), TypeError, r"a\[0\]"),
    ("gg b count", _gg, dict(b=[torch.randn(D, 8)]), ValueError, "b"),
    ("gg b not a sequence", _gg, dict(b=5), TypeError, "b"),
    ("gg b[1] wrong K", _gg, dict(b=[torch.randn(D, 8), torch.randn(D + 1, 8)]), ValueError, r"b\[1\]"),
    ("gg b[1] wrong N", _gg, dict(b=[torch.randn(D, 8), torch.randn(D, 9)]), ValueError, r"b\[1\]"),
    ("gg b[0] dtype", _gg, dict(b=[torch.randn(D, 8).bfloat16(), torch.randn(D, 8)]), TypeError, r"b\[0\]"),
    ("gg 3d b wrong G", _gg, dict(b=torch.randn(3, D, 8)), ValueError, "b"),
    ("gg 3d b wrong K", _gg, dict(b=torch.randn(2, D + 2, 8)), ValueError, "b"),
]


@pytest.mark.parametrize("what,fn,over,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_naming_the_argument(what, fn, over, exc, match):
    with pytest.raises(exc, match=match):
        fn(**over)


def test_mixed_devices_named():
    # A meta tensor stands in for "another device" on a CPU-only machine.
    with pytest.raises(ValueError, match="weight"):
        _rms(weight=torch.rand(D, device="meta"))
    with pytest.raises(ValueError, match="cos"):
        _rope(cos=torch.randn(5, D, device="meta"))
    with pytest.raises(ValueError, match="y"):
        _swiglu(y=torch.randn(4, D, device="meta"))
    with pytest.raises(ValueError, match=r"b\[1\]"):
        _gg(b=[torch.randn(D, 8), torch.randn(D, 8, device="meta")])


def test_good_calls_pass():
    assert _rms().shape == (4, D)
    assert _rms(weight=None).shape == (4, D)
    assert _rope().shape == (2, 5, 3, D)
    assert _swiglu().shape == (4, D)
    assert _softmax().shape == (4, D)
    assert _softmax(dim=1).shape == (4, D)
    assert [tuple(c.shape) for c in _gg()] == [(3, 8), (0, 8)]
    assert [tuple(c.shape) for c in _gg(b=torch.randn(2, D, 8))] == [(3, 8), (0, 8)]
    # cos/sin that require grad are fine when no graph is being built
    with torch.no_grad():
        assert _rope(cos=torch.randn(5, D, requires_grad=True)).shape == (2, 5, 3, D)
