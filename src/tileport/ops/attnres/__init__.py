"""AttnRes: attention over residual sources, as `fla.ops.attnres.fused_attnres` computes it.

    o = sum_l softmax_l(scale * <rms_norm(r_l) * rms_weight, query>) * r_l   [optionally rms-normed]

Public entry point: `fused_attnres` (FLA's signature). The call is validated here, then runs
through the torch.library custom ops `tileport::attnres_forward` / `tileport::attnres_backward`
(so it works under torch.compile), whose bodies ask the dispatcher for a backend:

    gluon      Hopper fast path (TMA ring on mbarriers, persistent), gluon_kernels.py
    triton     portable baseline (also the CPU path under TRITON_INTERPRET=1), triton_kernels.py
    reference  float64 PyTorch, the contract, reference.py
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from tileport.autograd_ops import (
    backends_forced_from,
    carries_forced_backends,
    forced_backends_arg,
    register_autograd,
)
from tileport.devices import capability
from tileport.dispatch import Backend, OpDispatcher, gluon_available, kernel_dtype_and_capability_refusal, lazy_stages, reference_backend, register, triton_available
from tileport.memory import new_copy
from tileport.ops.attnres.reference import attnres_reference

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # float64 runs on the reference only


# --------------------------------------------------------------------------------------------
# Input validation: every bad input is a ValueError/TypeError naming the argument.
# --------------------------------------------------------------------------------------------
def _check_float_tensor(name: str, t, device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (bfloat16, float16, float32; float64 on the reference backend), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but residuals are on {device}; put every tensor on one device")


def validate_attnres_args(query, residuals, rms_weight, output_rms_weight, rms_eps, scale, return_weights, checkpoint_level):
    if isinstance(residuals, torch.Tensor) or not isinstance(residuals, Sequence):
        raise TypeError(
            "residuals must be a non-empty sequence (list or tuple) of tensors [..., D], "
            f"got {type(residuals).__name__}"
        )
    if len(residuals) == 0:
        raise ValueError("residuals must be a non-empty sequence of tensors [..., D], got an empty sequence")
    first = residuals[0]
    _check_float_tensor("residuals[0]", first)
    if first.dim() == 0:
        raise ValueError("residuals[0] must have shape [..., D] (at least 1 dimension), got a 0-d tensor")
    D = first.shape[-1]
    if D == 0:
        raise ValueError("residuals[0] has D = 0 (last dimension); D must be at least 1")
    for i, r in enumerate(residuals[1:], start=1):
        _check_float_tensor(f"residuals[{i}]", r)
        if r.dtype != first.dtype:
            raise TypeError(f"residuals[{i}] has dtype {r.dtype} but residuals[0] has {first.dtype}; all sources must share one dtype")
        if r.device != first.device:
            raise ValueError(f"residuals[{i}] is on {r.device} but residuals[0] is on {first.device}")
        if r.shape != first.shape:
            raise ValueError(f"residuals[{i}] has shape {tuple(r.shape)} but residuals[0] has {tuple(first.shape)}; all sources must share one shape")
    _check_float_tensor("query", query, first.device)
    if query.numel() != D or query.dim() not in (1, 2) or (query.dim() == 2 and query.shape[1] != 1):
        raise ValueError(f"query must have shape [D] or [D, 1] with D = {D} (residuals' last dim), got {tuple(query.shape)}")
    _check_float_tensor("rms_weight", rms_weight, first.device)
    if rms_weight.numel() != D or rms_weight.dim() != 1:
        raise ValueError(f"rms_weight must have shape [D] with D = {D}, got {tuple(rms_weight.shape)}")
    if output_rms_weight is not None:
        _check_float_tensor("output_rms_weight", output_rms_weight, first.device)
        if output_rms_weight.numel() != D or output_rms_weight.dim() != 1:
            raise ValueError(f"output_rms_weight must have shape [D] with D = {D}, got {tuple(output_rms_weight.shape)}")
    if isinstance(rms_eps, bool) or not isinstance(rms_eps, (int, float)) or not (rms_eps > 0 and math.isfinite(rms_eps)):
        raise ValueError(f"rms_eps must be a positive finite float, got {rms_eps!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights must be a bool, got {type(return_weights).__name__}")
    if checkpoint_level not in (0, 1):
        raise ValueError(f"checkpoint_level must be 0 or 1, got {checkpoint_level!r}")


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AttnResCall:
    """What backends decide on. Built once per call; hashable, so decisions are cached on it."""

    L: int
    D: int
    dtype: torch.dtype
    device_type: str
    capability: tuple[int, int] | None
    aligned16: bool  # every source's data_ptr is 16-byte aligned


def _describe(query, residuals) -> AttnResCall:
    r0 = residuals[0]
    cap = capability(r0.device)
    aligned = all(r.data_ptr() % 16 == 0 for r in residuals)
    return AttnResCall(len(residuals), r0.shape[-1], r0.dtype, r0.device.type, cap, aligned)


def _reference_forward(query, residuals, rms_weight, output_rms_weight, eps, scale, return_weights):
    o, p = attnres_reference(query, residuals, rms_weight, output_rms_weight, eps, scale)
    return new_copy(o, residuals[0].dtype), (new_copy(p, torch.float32) if return_weights else None)


def _reference_backward(grad_o, query, residuals, rms_weight, output_rms_weight, eps, scale):
    # The closed-form gradient in float64 (autograd is switched off inside a custom op's body).
    # The parity tests check it, like every backend, against autograd through attnres_reference.
    f64 = torch.float64
    D = query.numel()
    r = torch.stack([x.to(f64) for x in residuals])  # [L, N, D]
    qw = query.to(f64) * rms_weight.to(f64)
    rstd = torch.rsqrt(r.pow(2).mean(-1) + eps)  # [L, N]
    dot_qw = r @ qw  # [L, N]
    p = torch.softmax(scale * rstd * dot_qw, dim=0)
    o_pre = (p.unsqueeze(-1) * r).sum(0)  # [N, D]
    dy = grad_o.to(f64)
    dow = None
    if output_rms_weight is not None:
        rstd_o = torch.rsqrt(o_pre.pow(2).mean(-1, keepdim=True) + eps)
        g = dy * output_rms_weight.to(f64)
        do = rstd_o * g - o_pre * rstd_o.pow(3) * (g * o_pre).mean(-1, keepdim=True)
        dow = new_copy((dy * o_pre * rstd_o).sum(0), output_rms_weight.dtype)
    else:
        do = dy
    dp = (r * do).sum(-1)  # [L, N]
    ds = p * (dp - (p * dp).sum(0))
    coef = (ds * scale * rstd).unsqueeze(-1)
    dr = p.unsqueeze(-1) * do + coef * (qw - (rstd.pow(2) * dot_qw / D).unsqueeze(-1) * r)
    G = (coef * r).sum((0, 1))
    dq = new_copy(G * rms_weight.to(f64), query.dtype)
    dw = new_copy(G * query.to(f64), rms_weight.dtype)
    return [new_copy(dr[i], x.dtype) for i, x in enumerate(residuals)], dq, dw, dow


def _triton_refusal(call: AttnResCall) -> str | None:
    from tileport.ops.attnres.triton_kernels import triton_refusal

    common = kernel_dtype_and_capability_refusal(call.dtype, call.device_type, call.capability)
    if common:
        return common
    return triton_refusal(call.L, call.D, call.dtype)


def _gluon_refusal(call: AttnResCall) -> str | None:
    from tileport.ops.attnres.gluon_kernels import gluon_refusal

    if call.dtype not in KERNEL_DTYPES:
        return f"{call.dtype} is not a kernel dtype (bfloat16, float16, float32)"
    if call.capability != (9, 0):
        return f"needs a Hopper GPU (sm_90), got {call.device_type} {call.capability}"
    if not call.aligned16:
        return "a residual's data pointer is not 16-byte aligned (TMA needs it)"
    return gluon_refusal(call.L, call.D, call.dtype)


DISPATCHER = register(
    OpDispatcher(
        "attnres",
        [
            Backend("gluon", gluon_available("tileport.ops.attnres.gluon_kernels"), _gluon_refusal,
                    lazy_stages("tileport.ops.attnres.gluon_kernels", "attnres_forward_gluon", "attnres_backward_gluon")),
            Backend("triton", triton_available("tileport.ops.attnres.triton_kernels"), _triton_refusal,
                    lazy_stages("tileport.ops.attnres.triton_kernels", "attnres_forward_triton", "attnres_backward_triton")),
            reference_backend(_reference_forward, _reference_backward),
        ],
        signature=lambda call: call,
    )
)


def _flat(residuals, D):
    """[N, D] contiguous views of the sources (a copy only for a non-contiguous source)."""
    return tuple(r if (r.dim() == 2 and r.is_contiguous()) else r.reshape(-1, D).contiguous() for r in residuals)


# --------------------------------------------------------------------------------------------
# torch.library custom ops: opaque to torch.compile, dispatching at run time.
# --------------------------------------------------------------------------------------------
def _forward_impl(query, residuals, rms_weight, output_rms_weight, eps, scale, return_weights):
    """Validate-free forward body shared by the eager autograd.Function and the custom op."""
    r0 = residuals[0]
    D = r0.shape[-1]
    lead = r0.shape[:-1]
    flat = _flat(residuals, D)
    q = query.reshape(D).contiguous()
    if flat[0].shape[0] == 0:
        o = r0.new_empty(r0.shape)
        p = torch.empty((len(residuals), *lead) if return_weights else (1,), dtype=torch.float32, device=r0.device)
        return o, p
    backend = DISPATCHER.choose(_describe(q, flat), r0.device.type)
    o, p = backend.impl.forward(q, flat, rms_weight.contiguous(),
                                None if output_rms_weight is None else output_rms_weight.contiguous(),
                                float(eps), float(scale), return_weights)
    o = o.view(r0.shape)
    if p is None:
        # A placeholder (the op's schema always returns p). One element, not zero: torch 2.11's
        # custom-op aliasing check rejects zero-size CUDA outputs (seen on the H200).
        p = torch.empty((1,), dtype=torch.float32, device=r0.device)
    else:
        p = p.view(len(residuals), *lead)
    return o, p


def _backward_impl(grad_o, query, residuals, rms_weight, output_rms_weight, eps, scale):
    """Backward body: [d query, d rms_weight, d output_rms_weight (placeholder if none), *d residuals]."""
    r0 = residuals[0]
    D = r0.shape[-1]
    flat = _flat(residuals, D)
    q = query.reshape(D).contiguous()
    if flat[0].shape[0] == 0:
        zeros = [torch.zeros_like(query), torch.zeros_like(rms_weight)]
        zeros.append(torch.zeros_like(output_rms_weight) if output_rms_weight is not None else rms_weight.new_zeros(1))
        return zeros + [torch.zeros_like(r) for r in residuals]
    backend = DISPATCHER.choose(_describe(q, flat), r0.device.type)
    grad_res, dq, dw, dow = backend.impl.backward(
        grad_o.reshape(-1, D).to(r0.dtype).contiguous(), q, flat, rms_weight.contiguous(),
        None if output_rms_weight is None else output_rms_weight.contiguous(), float(eps), float(scale))
    if dow is None:  # placeholder: one element (see the forward's p)
        dow = rms_weight.new_zeros(1)
    return [dq.view(query.shape), dw, dow] + [g.view(r0.shape) for g in grad_res]


@carries_forced_backends
class _AttnResFunction(torch.autograd.Function):
    """The eager path: the same bodies as the custom ops, without torch.library's per-call
    checks (tens of microseconds, and on torch 2.11 + CUDA its aliasing check raised
    spuriously on this op's list output; seen on the H200)."""

    @staticmethod
    def forward(ctx, query, rms_weight, output_rms_weight, eps, scale, return_weights, *residuals):
        o, p = _forward_impl(query, list(residuals), rms_weight, output_rms_weight, eps, scale, return_weights)
        ctx.n_res, ctx.has_ow, ctx.eps, ctx.scale = len(residuals), output_rms_weight is not None, eps, scale
        ctx.save_for_backward(query, rms_weight, *residuals, *([output_rms_weight] if output_rms_weight is not None else []))
        ctx.mark_non_differentiable(p)
        return o, p

    @staticmethod
    def backward(ctx, grad_o, grad_p):
        saved = ctx.saved_tensors
        query, rms_weight = saved[0], saved[1]
        residuals = list(saved[2 : 2 + ctx.n_res])
        ow = saved[-1] if ctx.has_ow else None
        grads = _backward_impl(grad_o, query, residuals, rms_weight, ow, ctx.eps, ctx.scale)
        return (grads[0], grads[1], grads[2] if ctx.has_ow else None, None, None, None, *grads[3:])


@torch.library.custom_op("tileport::attnres_forward", mutates_args=())
def _attnres_forward_op(
    query: torch.Tensor,
    residuals: list[torch.Tensor],
    rms_weight: torch.Tensor,
    output_rms_weight: torch.Tensor | None,
    eps: float,
    scale: float,
    return_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_impl(query, residuals, rms_weight, output_rms_weight, eps, scale, return_weights)


@_attnres_forward_op.register_fake
def _(query, residuals, rms_weight, output_rms_weight, eps, scale, return_weights):
    r0 = residuals[0]
    p_shape = (len(residuals), *r0.shape[:-1]) if return_weights else (1,)
    return r0.new_empty(r0.shape), r0.new_empty(p_shape, dtype=torch.float32)


@torch.library.custom_op("tileport::attnres_backward", mutates_args=())
def _attnres_backward_op(
    grad_o: torch.Tensor,
    query: torch.Tensor,
    residuals: list[torch.Tensor],
    rms_weight: torch.Tensor,
    output_rms_weight: torch.Tensor | None,
    eps: float,
    scale: float,
    forced: str,
) -> list[torch.Tensor]:
    # Returns [d query, d rms_weight, d output_rms_weight, d residuals stacked [L, ...]]: the
    # kernels write the L gradients into one [L, N, D] buffer, and a custom op may not return
    # several views of one storage, so the stacked buffer itself is the output (no copy).
    with backends_forced_from(forced):  # the forward's forced backends (tileport.autograd_ops)
        grads = _backward_impl(grad_o, query, residuals, rms_weight, output_rms_weight, eps, scale)
    return grads[:3] + [_stacked(grads[3:])]


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """The [L, ...] tensor whose rows are `parts`: their common base when they are its
    consecutive rows (what the kernels allocate), else a stacked copy."""
    base = parts[0]._base
    if (base is not None and base.is_contiguous() and base.shape[0] == len(parts)
            and base.shape[1:].numel() == parts[0].numel()
            and all(p._base is base and p.data_ptr() == base[i].data_ptr() for i, p in enumerate(parts))):
        return base.view(len(parts), *parts[0].shape)
    return torch.stack(parts)


@_attnres_backward_op.register_fake
def _(grad_o, query, residuals, rms_weight, output_rms_weight, eps, scale, forced):
    dow = output_rms_weight.new_empty(output_rms_weight.shape) if output_rms_weight is not None else rms_weight.new_empty(1)
    r0 = residuals[0]
    return [query.new_empty(query.shape), rms_weight.new_empty(rms_weight.shape), dow,
            r0.new_empty((len(residuals), *r0.shape))]


def _setup_context(ctx, inputs, output):
    query, residuals, rms_weight, output_rms_weight, eps, scale, _ = inputs
    ctx.n_res = len(residuals)
    ctx.has_ow = output_rms_weight is not None
    ctx.eps, ctx.scale = eps, scale
    saved = [query, rms_weight, *residuals]
    if output_rms_weight is not None:
        saved.append(output_rms_weight)
    ctx.save_for_backward(*saved)


def _backward(ctx, grad_o, grad_p):
    # p is returned for inspection only (as in FLA): it carries no gradient.
    saved = ctx.saved_tensors
    query, rms_weight = saved[0], saved[1]
    residuals = list(saved[2 : 2 + ctx.n_res])
    ow = saved[-1] if ctx.has_ow else None
    grads = _attnres_backward_op(grad_o, query, residuals, rms_weight, ow, ctx.eps, ctx.scale, forced_backends_arg(ctx))
    dq, dw, dow = grads[0], grads[1], grads[2]
    return dq, list(grads[3].unbind(0)), dw, (dow if ctx.has_ow else None), None, None, None


register_autograd("tileport::attnres_forward", _backward, _setup_context)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def fused_attnres(
    query: torch.Tensor,
    residuals: Sequence[torch.Tensor],
    rms_weight: torch.Tensor,
    output_rms_weight: torch.Tensor | None = None,
    rms_eps: float = 1e-6,
    scale: float = 1.0,
    return_weights: bool = False,
    checkpoint_level: int = 1,
):
    """AttnRes residual aggregation, a drop-in for `fla.ops.attnres.fused_attnres`.

    Args:
        query: pseudo-query `[D]` (or `[D, 1]`).
        residuals: non-empty sequence of L tensors `[..., D]`, one shape, dtype and device.
        rms_weight: `[D]` RMSNorm weight for the keys.
        output_rms_weight: optional `[D]`; RMS-normalises the output with it.
        rms_eps: RMSNorm epsilon (both norms). scale: logit scale.
        return_weights: also return the softmax weights p `[L, ...]` (float32, no gradient).
        checkpoint_level: accepted for FLA compatibility (0 or 1); tileport always recomputes
            the forward statistics in the backward and saves nothing but the inputs.
    Returns:
        o `[..., D]` in the residuals' dtype, and p when `return_weights`.
    """
    validate_attnres_args(query, residuals, rms_weight, output_rms_weight, rms_eps, scale, return_weights, checkpoint_level)
    if torch.compiler.is_compiling():  # the custom op: opaque to the compiler, with a fake impl
        o, p = _attnres_forward_op(query, list(residuals), rms_weight, output_rms_weight, float(rms_eps), float(scale), return_weights)
    else:
        o, p = _AttnResFunction.apply(query, rms_weight, output_rms_weight, float(rms_eps), float(scale), return_weights, *residuals)
    return (o, p) if return_weights else o


__all__ = ["fused_attnres", "attnres_reference", "DISPATCHER", "AttnResCall"]


def explain_call(shape: str, dtype: torch.dtype, device_type: str, capability: tuple[int, int] | None) -> AttnResCall:
    """The call `tileport explain attnres --shape L,N,D` describes (aligned sources assumed)."""
    try:
        L, _N, D = (int(x) for x in shape.split(","))
    except ValueError:
        raise ValueError(f"--shape for attnres is L,N,D (e.g. 8,16384,2048), got {shape!r}") from None
    return AttnResCall(L, D, dtype, device_type, capability, True)
