"""Argument checks shared by the ops' public functions: errors name the argument."""

from __future__ import annotations

import math

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_float_tensor(name: str, t, device: torch.device | None = None, device_of: str = "x") -> None:
    """TypeError unless `t` is a floating tensor of a supported dtype; ValueError if on another device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (bfloat16, float16, float32; float64 on the reference backend), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but {device_of} is on {device}; put every tensor on one device")


def check_eps(eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a positive finite float, got {eps!r}")
