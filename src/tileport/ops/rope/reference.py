"""RoPE (rotate-half form) float64 reference: the frozen contract every backend is checked against.

    y = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

x [B, T, H, D]; cos, sin [T, D], broadcast over B and H. Plain PyTorch in float64, differentiable
in x (cos and sin are constants). Kernel work never edits this file.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """y [B, T, H, D] in float64."""
    x64 = x.to(torch.float64)
    c = cos.to(torch.float64)[None, :, None, :]
    s = sin.to(torch.float64)[None, :, None, :]
    return x64 * c + rotate_half(x64) * s
