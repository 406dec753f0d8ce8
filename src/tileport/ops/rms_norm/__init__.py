"""RMSNorm over the last dimension: `rms_norm(x, weight=None, eps=1e-6)`.

    y = x * rsqrt(mean(x^2, dim=-1) + eps) * weight

Gradients for x and weight. Math in fp32 (float64 on the reference); y in x's dtype, d weight in
weight's dtype. The call is validated here, then runs through the torch.library custom ops
`tileport::rms_norm_forward` / `tileport::rms_norm_backward` under torch.compile (an
autograd.Function in eager mode), whose bodies ask the dispatcher for a backend, in this order:

    gluon      (Hopper; rows of a power-of-two D up to 8192) the forward as a persistent TMA ring
               over row tiles (tileport/gluon_rows.py), the backward a paired ring of x and dy
               (gluon_kernels.BACKWARD, "gluon" since the H200 timed it: docs/perf/llm_ops.md
               row 9); gluon_kernels.py
    triton     row kernels (tensor descriptors on sm_90), triton_kernels.py
    cutile     cuda.tile kernels, the source the Triton ones port (compiled for sm_90 in CI; run on
               the H200 with the toolchain of scripts/fetch_cutile), cutile_kernels.py
    reference  float64 PyTorch, the contract, reference.py
"""

from __future__ import annotations

import dataclasses

import torch

from tileport.autograd_ops import (
    backends_forced_from,
    carries_forced_backends,
    forced_backends_arg,
    register_autograd,
)
from tileport.devices import capability
from tileport.validation import check_eps, check_float_tensor
from tileport.cutile_support import cutile_available
from tileport.dispatch import Backend, OpDispatcher, capability_refusal, gluon_available, lazy_stages, reference_backend, register, triton_available
from tileport.memory import new_empty, new_copy
from tileport.ops.rms_norm.reference import rms_norm_reference

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # float64 runs on the reference only


# --------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------
def validate_rms_norm_args(x, weight, eps) -> None:
    check_float_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have shape [..., D] (at least 1 dimension), got a 0-d tensor")
    D = x.shape[-1]
    if D == 0:
        raise ValueError("x has D = 0 (last dimension); D must be at least 1")
    if weight is not None:
        check_float_tensor("weight", weight, x.device)
        if weight.dim() != 1 or weight.shape[0] != D:
            raise ValueError(f"weight must have shape [D] with D = {D} (x's last dim), got {tuple(weight.shape)}")
    check_eps(eps)


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RMSNormCall:
    """What backends decide on (hashable: decisions are cached on it)."""

    D: int
    dtype: torch.dtype
    weight_dtype: torch.dtype | None
    device_type: str
    capability: tuple[int, int] | None


def _describe(x, weight) -> RMSNormCall:
    cap = capability(x.device)
    return RMSNormCall(x.shape[-1], x.dtype, None if weight is None else weight.dtype, x.device.type, cap)


def _reference_forward(x, weight, eps):
    return new_copy(rms_norm_reference(x, weight, eps), x.dtype)


def _reference_backward(grad_y, x, weight, eps, want_dw):
    # Closed form in float64 (autograd is off inside a custom op's body); the parity tests check
    # it against autograd through rms_norm_reference like every backend.
    x64 = x.to(torch.float64)
    dy = grad_y.to(torch.float64)
    D = x.shape[-1]
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    g = dy * weight.to(torch.float64) if weight is not None else dy
    dx = rstd * g - x64 * rstd.pow(3) * (g * x64).sum(-1, keepdim=True) / D
    dw = None
    if want_dw and weight is not None:
        dw = new_copy((dy * x64 * rstd).reshape(-1, D).sum(0), weight.dtype)
    return new_copy(dx, x.dtype), dw


def _triton_refusal(call: RMSNormCall) -> str | None:
    from tileport.ops.rms_norm.triton_kernels import triton_refusal

    cap = capability_refusal(call.device_type, call.capability)
    if cap:
        return cap
    return triton_refusal(call.D, call.dtype, call.weight_dtype)


def _cutile_refusal(call: RMSNormCall) -> str | None:
    """Triton's dtype rules (the kernels take the same dtypes), on sm_90 or newer."""
    from tileport.ops.rms_norm.triton_kernels import triton_refusal

    reason = capability_refusal(call.device_type, call.capability, (9, 0)) or triton_refusal(call.D, call.dtype, call.weight_dtype)
    if reason:
        return reason
    from tileport.ops.rms_norm.cutile_kernels import cutile_refusal

    return cutile_refusal(call.D)


def _gluon_refusal(call: RMSNormCall) -> str | None:
    from tileport.ops.rms_norm.gluon_kernels import gluon_refusal

    if call.capability != (9, 0):
        return f"needs a Hopper GPU (sm_90), got {call.device_type} {call.capability}"
    # the backward with gluon_kernels.BACKWARD = "triton" and the forward and backward of rows
    # TMA cannot read are Triton's: its refusal applies
    return _triton_refusal(call) or gluon_refusal(call.D, call.dtype, call.weight_dtype)


# Preference: gluon (forward and backward; gluon_kernels.BACKWARD), triton, cutile, then the float64
# reference. H200, bench at 26c97d1 (one run, 8192 x 4096 bf16): forward 0.071 ms eager, 0.037 as a
# CUDA graph, against Triton's 0.121 / 0.050 and cuTile's 0.080 / 0.075 (14963d1); docs/perf/llm_ops.md row 3.
DISPATCHER = register(
    OpDispatcher(
        "rms_norm",
        [
            Backend("gluon", gluon_available("tileport.ops.rms_norm.gluon_kernels"), _gluon_refusal,
                    lazy_stages("tileport.ops.rms_norm.gluon_kernels", "rms_norm_forward_gluon", "rms_norm_backward_gluon")),
            Backend("triton", triton_available("tileport.ops.rms_norm.triton_kernels"), _triton_refusal,
                    lazy_stages("tileport.ops.rms_norm.triton_kernels", "rms_norm_forward_triton", "rms_norm_backward_triton")),
            Backend("cutile", cutile_available("tileport.ops.rms_norm.cutile_kernels"), _cutile_refusal,
                    lazy_stages("tileport.ops.rms_norm.cutile_kernels", "rms_norm_forward_cutile", "rms_norm_backward_cutile")),
            reference_backend(_reference_forward, _reference_backward),
        ],
        signature=lambda call: call,
    )
)


# --------------------------------------------------------------------------------------------
# Bodies shared by the eager autograd.Function and the custom ops
# --------------------------------------------------------------------------------------------
def _forward_impl(x, weight, eps):
    if x.numel() == 0:
        return new_empty(x.shape, x.dtype, x.device)
    backend = DISPATCHER.choose(_describe(x, weight), x.device.type)
    return backend.impl.forward(x, weight, float(eps))


def _backward_impl(grad_y, x, weight, eps, want_dw):
    """(dx, d weight or None)."""
    if x.numel() == 0:
        dw = torch.zeros_like(weight) if (want_dw and weight is not None) else None
        return torch.zeros_like(x), dw
    backend = DISPATCHER.choose(_describe(x, weight), x.device.type)
    return backend.impl.backward(grad_y.to(x.dtype), x, weight, float(eps), want_dw)


@carries_forced_backends
class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y = _forward_impl(x, weight, eps)
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        want_dw = weight is not None and ctx.needs_input_grad[1]
        dx, dw = _backward_impl(grad_y, x, weight, ctx.eps, want_dw)
        return dx, dw, None


@torch.library.custom_op("tileport::rms_norm_forward", mutates_args=())
def _rms_norm_forward_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _forward_impl(x, weight, eps)


@_rms_norm_forward_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("tileport::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                          want_dw: bool, forced: str) -> tuple[torch.Tensor, torch.Tensor]:
    with backends_forced_from(forced):  # the forward's forced backends (tileport.autograd_ops)
        dx, dw = _backward_impl(grad_y, x, weight, eps, want_dw)
    if dw is None:  # placeholder: one element (torch 2.11 rejects zero-size CUDA custom-op outputs)
        dw = x.new_zeros(1)
    return dx, dw


@_rms_norm_backward_op.register_fake
def _(grad_y, x, weight, eps, want_dw, forced):
    dw = weight.new_empty(weight.shape) if (want_dw and weight is not None) else x.new_empty(1)
    return x.new_empty(x.shape), dw


def _setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    want_dw = weight is not None and ctx.needs_input_grad[1]
    dx, dw = _rms_norm_backward_op(grad_y, x, weight, ctx.eps, want_dw, forced_backends_arg(ctx))
    return dx, (dw if want_dw else None), None


register_autograd("tileport::rms_norm_forward", _backward, _setup_context)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension.

    Args:
        x: `[..., D]` (bfloat16, float16, float32; float64 runs on the reference backend).
        weight: optional `[D]` scale, any supported float dtype.
        eps: added to the mean square, positive.
    Returns:
        y `[..., D]` in x's dtype. Differentiable in x and weight.
    """
    validate_rms_norm_args(x, weight, eps)
    if torch.compiler.is_compiling():
        return _rms_norm_forward_op(x, weight, float(eps))
    return _RMSNormFunction.apply(x, weight, float(eps))


def explain_call(shape: str, dtype: torch.dtype, device_type: str, capability: tuple[int, int] | None) -> RMSNormCall:
    """The call `tileport explain rms_norm --shape M,D` describes (weight in x's dtype)."""
    try:
        _M, D = (int(v) for v in shape.split(","))
    except ValueError:
        raise ValueError(f"--shape for rms_norm is M,D (e.g. 8192,4096), got {shape!r}") from None
    return RMSNormCall(D, dtype, dtype, device_type, capability)


__all__ = ["rms_norm", "rms_norm_reference", "DISPATCHER", "RMSNormCall", "explain_call"]
