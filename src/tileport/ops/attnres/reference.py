"""AttnRes float64 reference: the frozen contract every backend is checked against.

Written from SPEC.md, one line per equation, in float64 so that its own rounding is far
below every tolerance. Kernel work never edits this file.

    k_l = rms_norm(r_l) * rms_weight
    s_l = scale * <k_l, query>
    p   = softmax_l(s)
    o   = sum_l p_l * r_l                  (the raw sources, not the keys)
    o   = rms_norm(o) * output_rms_weight  (only when output_rms_weight is given)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _rms_normalise(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def attnres_reference(
    query: torch.Tensor,
    residuals: Sequence[torch.Tensor],
    rms_weight: torch.Tensor,
    output_rms_weight: torch.Tensor | None = None,
    rms_eps: float = 1e-6,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (o, p) in float64: o [..., D], p [L, ...]. Differentiable in every tensor input."""
    D = residuals[0].shape[-1]
    r = torch.stack([x.to(torch.float64).reshape(-1, D) for x in residuals])  # [L, N, D]
    q = query.to(torch.float64).reshape(D)
    k = _rms_normalise(r, rms_weight.to(torch.float64).reshape(D), rms_eps)
    s = scale * (k @ q)  # [L, N]
    p = torch.softmax(s, dim=0)
    o = (p.unsqueeze(-1) * r).sum(dim=0)  # [N, D]
    if output_rms_weight is not None:
        o = _rms_normalise(o, output_rms_weight.to(torch.float64).reshape(D), rms_eps)
    lead = residuals[0].shape[:-1]
    return o.reshape(*lead, D), p.reshape(len(residuals), *lead)
