"""SwiGLU (silu-and-mul) float64 reference: the frozen contract every backend is checked against.

    out = silu(x) * y = x * sigmoid(x) * y

Plain PyTorch in float64, differentiable in x and y. Kernel work never edits this file.
"""

from __future__ import annotations

import torch


def swiglu_reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """out in float64, with x's shape."""
    return torch.nn.functional.silu(x.to(torch.float64)) * y.to(torch.float64)
