"""Pieces of the AttnRes backward shared by every kernel backend.

Kernels reduce the per-token parameter gradients over their own rows and write one fp32
row per program (`partials [P, D]`); these helpers finish the sum and apply the chain
rule through `query * rms_weight`, which costs a few tiny launches instead of a second kernel.

Definitions used by the kernels (per token n, source l, with rstd_l = 1/sqrt(mean(r_l^2)+eps)):
    qw        = query * rms_weight                   (fp32, [D])
    s_l       = scale * rstd_l * <r_l, qw>
    G         = sum_n sum_l ds_l * rstd_l * r_l      (what `qw_partials` rows sum to)
    d query   = scale * G * rms_weight
    d rms_w   = scale * G * query
    d out_w   = sum_n dy * o_pre * rstd_o            (what `out_w_partials` rows sum to)
"""

from __future__ import annotations

import torch


def finish_parameter_grads(
    qw_partials: torch.Tensor,
    out_w_partials: torch.Tensor | None,
    query: torch.Tensor,
    rms_weight: torch.Tensor,
    output_rms_weight: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = qw_partials.sum(dim=0, dtype=torch.float32)
    grad_query = (g * rms_weight.float()).mul_(scale).to(query.dtype)
    grad_rms_weight = (g * query.float()).mul_(scale).to(rms_weight.dtype)
    grad_out_w = None
    if output_rms_weight is not None:
        grad_out_w = out_w_partials.sum(dim=0, dtype=torch.float32).to(output_rms_weight.dtype)
    return grad_query, grad_rms_weight, grad_out_w
