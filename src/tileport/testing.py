"""The parity gate's machinery: the error metric, SPEC.md's bounds, poisoning, backend selection.

    rel(out, ref) = ||out - ref|| / ||ref||     (computed in float64; NaN or Inf never passes)

One case the metric cannot judge: a reference that lies wholly below the smallest normal number
of the output's dtype (a KDA final state after a run of beta = 0 steps with gates of -50..-1000:
norm 1.7e-54, found 2026-11-29). There no output of that dtype can come within any relative
bound (fp32 holds nothing near 1e-54; the float64 reference itself, returned as fp32, is all
zeros: rel = 1), so `check` asks instead that every element of the output lie below that
smallest normal too, as the reference's do. Any reference with one element in the normal range
is judged by rel alone.

Bounds (SPEC.md, "Correctness"): fp32 inputs 1e-5 (5e-3 where a matmul may run in tf32);
bf16/fp16 inputs 1e-2 for outputs, states and the gradients of the main inputs, 3e-2 for the
gradients of gates and beta. These numbers live here only, and tests never pass their own.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import torch

from tileport.dispatch import REGISTRY, interpreter_enabled, use_backend
from tileport.memory import poison_new_buffers

OUTPUT = "output"  # outputs, final states, gradients of q/k/v/residuals/initial state
GATE = "gate"  # gradients of gates and beta

_BOUNDS = {
    torch.float32: {OUTPUT: 1e-5, GATE: 1e-5},
    torch.bfloat16: {OUTPUT: 1e-2, GATE: 3e-2},
    torch.float16: {OUTPUT: 1e-2, GATE: 3e-2},
}
TF32_BOUND = 5e-3


def bound(input_dtype: torch.dtype, kind: str = OUTPUT, tf32: bool = False) -> float:
    if input_dtype == torch.float32 and tf32:
        return TF32_BOUND
    if input_dtype == torch.float64:
        return 1e-12
    return _BOUNDS[input_dtype][kind]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out has NaN/Inf or the shapes differ."""
    if out.shape != ref.shape:
        return math.inf
    o = out.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    if not torch.isfinite(o).all():
        return math.inf
    denom = r.norm().item()
    num = (o - r).norm().item()
    if denom == 0.0:
        return num
    return num / denom


class ParityError(AssertionError):
    pass


def check(name: str, out: torch.Tensor, ref: torch.Tensor, input_dtype: torch.dtype, kind: str = OUTPUT, tf32: bool = False) -> float:
    """Raise ParityError if rel(out, ref) is over the bound for `input_dtype`; return rel. A
    reference below the smallest normal of out's dtype is checked as the module docstring says."""
    lim = bound(input_dtype, kind, tf32)
    if out.shape == ref.shape and out.dtype.is_floating_point and out.dtype != torch.float64:
        tiny = torch.finfo(out.dtype).tiny
        r = ref.detach().to(torch.float64).cpu()
        if r.numel() and 0.0 < r.abs().max().item() < tiny:
            o = out.detach().to(torch.float64).cpu()
            if not (torch.isfinite(o).all() and o.abs().max().item() < tiny):
                raise ParityError(f"{name}: the reference lies below {out.dtype}'s smallest normal ({tiny:.1e}; "
                                  f"max |ref| {r.abs().max().item():.1e}) and the output does not "
                                  f"(max |out| {o.abs().max().item():.1e})")
            return 0.0
    err = rel_error(out, ref)
    if not err <= lim:
        nonfinite = (~torch.isfinite(out.detach())).sum().item() if out.shape == ref.shape else None
        extra = f" ({nonfinite} non-finite elements: unwritten or overflowed)" if nonfinite else ""
        raise ParityError(f"{name}: rel error {err:.3e} > bound {lim:.0e} for {input_dtype}{extra}")
    return err


@contextlib.contextmanager
def poisoned():
    """Every buffer tileport allocates inside this block starts as NaN."""
    with poison_new_buffers(True):
        yield


def backend_skip_reason(op: str, name: str, device_type: str) -> str | None:
    """Why `name` can't run on this machine for `op` (None if it can): used to skip with a reason."""
    disp = REGISTRY[op]
    if name not in disp._by_name:
        return f"{op} has no {name} backend"
    b = disp._by_name[name]
    if not disp._applies(b, device_type):
        from tileport.dispatch import _not_meant_for

        return _not_meant_for(name, device_type)
    return disp.availability(b)


def test_device() -> str:
    """Where tests run: TILEPORT_TEST_DEVICE, else cuda when present, else cpu."""
    dev = os.environ.get("TILEPORT_TEST_DEVICE")
    if dev:
        return dev
    return "cuda" if torch.cuda.is_available() else "cpu"


def on_gpu() -> bool:
    return test_device().startswith("cuda")


__all__ = [
    "OUTPUT", "GATE", "bound", "rel_error", "check", "ParityError", "poisoned", "use_backend",
    "backend_skip_reason", "test_device", "on_gpu", "interpreter_enabled",
]


# --------------------------------------------------------------------------------------------
# A kernel fault ends its pytest worker (tests/conftest.py takes these hooks)
# --------------------------------------------------------------------------------------------
# A kernel that faults on the GPU (an illegal address, a misaligned access, an unspecified launch
# failure) leaves its process's CUDA context unusable: every later CUDA call there fails. Under
# pytest-xdist every later test of that worker then errored: in the KDA gate at 7e672c1 one
# faulting test took 131 others with it, and the report named 133 failures for one fault. So a test
# that hits one ends its worker (xdist reports the test as crashed and starts a fresh worker for the
# rest); outside xdist the run stops there, saying why.
STICKY_CUDA_ERRORS = ("illegal memory access", "illegal address", "misaligned address", "illegal instruction",
                      "unspecified launch failure", "hardware stack error")
_fault = {"nodeid": None, "text": ""}


def is_sticky_cuda_error(text: str) -> bool:
    """Whether an exception's text names a CUDA error that leaves the context unusable."""
    return any(s in text for s in STICKY_CUDA_ERRORS)


def pytest_runtest_makereport(item, call):
    """Notes a test (any phase) that failed with a sticky CUDA error: a RuntimeError (torch's
    AcceleratorError and Triton's launch errors are), not an assertion quoting one."""
    if call.excinfo is not None and _fault["nodeid"] is None and isinstance(call.excinfo.value, RuntimeError):
        text = f"{call.excinfo.typename}: {call.excinfo.value}"
        if is_sticky_cuda_error(text):
            _fault["nodeid"], _fault["text"] = item.nodeid, text.splitlines()[0][:300]


def pytest_runtest_logfinish(nodeid, location):
    """After the faulting test's reports: end this xdist worker, or stop a run without xdist."""
    if _fault["nodeid"] is None:
        return
    import pytest

    message = (f"{_fault['nodeid']} left this process's CUDA context unusable ({_fault['text']}); "
               "its later tests would all fail")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        sys.stderr.write(f"\ntileport: ending worker {os.environ['PYTEST_XDIST_WORKER']}: {message}\n")
        sys.stderr.flush()
        os._exit(3)
    pytest.exit(message, returncode=3)
