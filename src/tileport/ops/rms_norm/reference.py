"""RMSNorm float64 reference: the frozen contract every backend is checked against.

    y = x * rsqrt(mean(x^2, last dim) + eps) * weight        (weight optional)

Plain PyTorch in float64, differentiable in x and weight. Kernel work never edits this file.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """y [..., D] in float64."""
    x64 = x.to(torch.float64)
    y = x64 * torch.rsqrt(x64.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(torch.float64)
    return y
