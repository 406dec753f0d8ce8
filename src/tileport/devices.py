"""Per-device facts asked on every op call, cached per device index.

`torch.cuda.get_device_capability` and `get_device_properties` go through torch's lazy-init check
and a property lookup each time (a few microseconds); ops ask for them in every call's
description and launch configuration. A device's capability and SM count never change in a
process.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["capability", "sm_count"]


def _index(device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def capability(device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device (a torch.device, index or string); None for other devices."""
    if torch.device(device).type != "cuda":
        return None
    return _capability(_index(device))


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return _sm_count(_index(device))
