"""Grouped GEMM float64 reference: the frozen contract every backend is checked against.

    c_i = a_i @ b_i      a_i [M_i, K], b_i [K, N]   (one K and N, M_i free, M_i = 0 allowed)

Plain PyTorch in float64, differentiable in every a_i and b_i. Kernel work never edits this file.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def grouped_gemm_reference(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    """[c_i] in float64."""
    return [x.to(torch.float64) @ w.to(torch.float64) for x, w in zip(a, b)]
