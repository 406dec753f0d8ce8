"""The Gluon AttnRes kernels with device-side TMA descriptors (TILEPORT_ATTNRES_DESC=device).

The kernels then receive raw pointers and build their descriptors in global scratch from triton's
allocator (installed by tileport in threads that have none, autograd's backward thread included).
The same parity check as tests/test_attnres_parity.py::test_forward_backward, forward and
backward, on the shapes the Gluon kernels accept. GPU only (Gluon kernels don't run on the CPU;
their device-descriptor variants are compile-checked there by tests/test_gluon_compile.py).
"""

from __future__ import annotations

import pytest
import test_attnres_parity as parity  # a module import: pytest would collect an imported test function

SHAPES = [(1, (7,), 64), (8, (1,), 128), (8, (4097,), 2048), (4, (2, 333), 1024), (16, (1000,), 512), (2, (515,), 4096)]


@pytest.mark.parametrize("L,lead,D", SHAPES, ids=[f"L{L}-{'x'.join(map(str, lead))}-D{D}" for L, lead, D in SHAPES])
@pytest.mark.parametrize("dt", list(parity.DTYPES))
@pytest.mark.parametrize("out_norm", [False, True], ids=["plain", "outnorm"])
def test_device_descriptors_forward_backward(L, lead, D, dt, out_norm, device, seed, monkeypatch):
    monkeypatch.setenv("TILEPORT_ATTNRES_DESC", "device")
    parity.test_forward_backward("gluon", L, lead, D, dt, out_norm, device, seed)
