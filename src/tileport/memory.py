"""Every buffer a tileport kernel writes is allocated here, so the parity gate can poison it.

Under `tileport.testing.poisoned()` (or TILEPORT_POISON=1) new buffers are filled with NaN
(float) or with the dtype's largest value (integers) before any kernel sees them: an element
a kernel forgets to write then fails the parity check instead of passing on stale zeros.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from tileport.envvars import getenv

_state = threading.local()

def poisoning_enabled() -> bool:
    flag = getattr(_state, "poison", None)
    if flag is None:
        return getenv("TILEPORT_POISON", "0") == "1"
    return flag


@contextlib.contextmanager
def poison_new_buffers(enabled: bool = True):
    """Within this block, buffers from `new_empty` are filled with NaN."""
    before = getattr(_state, "poison", None)
    _state.poison = enabled
    try:
        yield
    finally:
        _state.poison = before


def new_empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty, poisoned under test. Use it for every output and scratch buffer."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if poisoning_enabled():
        if dtype.is_floating_point:
            out.fill_(float("nan"))
        else:
            out.fill_(torch.iinfo(dtype).max)
    return out


def device_table(rows, dtype: torch.dtype, device) -> torch.Tensor:
    """A small host-built table (a kernel's group or tile list) on `device`, without a stream sync:
    built in pinned memory and copied with non_blocking=True. `torch.tensor(...).to(device)` is a
    blocking copy from pageable memory: the host waits for the stream's earlier work, so each call
    of a grouped kernel waited for the previous call to finish before it could launch (the GPU
    idle for the host's Python and launch time: docs/perf/llm_ops.md row 6). torch's caching host
    allocator keeps the pinned block until the copy has run. Not a buffer a kernel writes: never
    poisoned."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(rows, dtype=dtype, device=device)
    return torch.tensor(rows, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def new_empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return new_empty(t.shape, dtype or t.dtype, t.device)


def new_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new (poisonable) buffer holding t in `dtype`: never an alias of t (op outputs must not be)."""
    return new_empty(t.shape, dtype, t.device).copy_(t)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., D] as [M, D] with unit last stride: a view, copied only when the last stride is not 1
    (the row kernels take any row stride)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def as_flat(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous 1-D tensor (a view when it already is contiguous)."""
    return t.contiguous().view(-1)
