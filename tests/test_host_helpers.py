"""Host-side helpers on every op call's path: they must agree with what they replace."""

from __future__ import annotations

import os

import pytest

from tileport.envvars import getenv
from tileport.shapes import cdiv, next_pow2


def test_getenv_sees_every_change_at_once(monkeypatch):
    name = "TILEPORT_TEST_ENV_PROBE"
    monkeypatch.delenv(name, raising=False)
    assert getenv(name) is None and getenv(name, "d") == "d"
    monkeypatch.setenv(name, "triton")
    assert getenv(name) == "triton" == os.environ.get(name)
    os.environ[name] = "é-ü"  # non-ASCII round trip
    assert getenv(name) == "é-ü"
    monkeypatch.delenv(name)
    assert getenv(name, "gone") == "gone"


def test_dispatch_follows_the_environment(monkeypatch):
    """A backend forced through the environment mid-run takes effect on the next call."""
    from tileport.dispatch import REGISTRY

    disp = REGISTRY["softmax"]
    monkeypatch.delenv("TILEPORT_SOFTMAX_BACKEND", raising=False)
    assert disp._settings()[0] is None
    monkeypatch.setenv("TILEPORT_SOFTMAX_BACKEND", "reference")
    assert disp._settings()[0] == "reference"


@pytest.mark.parametrize("n", [0, 1, 2, 3, 15, 16, 17, 63, 64, 65, 1000, 4096, 4097, 131072])
def test_shape_helpers_match_triton(n):
    triton = pytest.importorskip("triton")
    assert next_pow2(n) == triton.next_power_of_2(n)
    for b in (1, 3, 16, 64):
        assert cdiv(n, b) == triton.cdiv(n, b)
