"""Softmax float64 reference: the frozen contract every backend is checked against.

    y = exp(x - max(x)) / sum(exp(x - max(x)))      over the last dimension

Plain PyTorch in float64, differentiable in x. Kernel work never edits this file.
"""

from __future__ import annotations

import torch


def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """y [..., D] in float64."""
    return torch.softmax(x.to(torch.float64), dim=-1)
