"""SwiGLU (silu-and-mul): `swiglu(x, y) = silu(x) * y`, as `fla.modules.activations.swiglu(x, y)`.

    out = x * sigmoid(x) * y

x is the gate (the "a" of silu(a) * b), y the up projection. Same shape, dtype and device; any
shape. Gradients for x and y. Math in fp32 (float64 on the reference); out in the input dtype.
Runs through the torch.library custom ops `tileport::swiglu_forward` / `tileport::swiglu_backward`
under torch.compile (an autograd.Function in eager mode); backends:

    triton     flat elementwise kernels, triton_kernels.py
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
from tileport.cutile_support import cutile_available
from tileport.dispatch import Backend, OpDispatcher, capability_refusal, lazy_stages, reference_backend, register, triton_available
from tileport.memory import new_empty, new_copy
from tileport.validation import check_float_tensor
from tileport.ops.swiglu.reference import swiglu_reference


def validate_swiglu_args(x, y) -> None:
    check_float_tensor("x", x)
    check_float_tensor("y", y, x.device)
    if y.dtype != x.dtype:
        raise TypeError(f"y has dtype {y.dtype} but x has {x.dtype}; x and y must share one dtype")
    if y.shape != x.shape:
        raise ValueError(f"y has shape {tuple(y.shape)} but x has {tuple(x.shape)}; x and y must have one shape (no broadcasting)")


@dataclasses.dataclass(frozen=True)
class SwiGLUCall:
    dtype: torch.dtype
    device_type: str
    capability: tuple[int, int] | None


def _describe(x) -> SwiGLUCall:
    cap = capability(x.device)
    return SwiGLUCall(x.dtype, x.device.type, cap)


def _reference_forward(x, y):
    return new_copy(swiglu_reference(x, y), x.dtype)


def _reference_backward(grad_out, x, y):
    x64, y64, g = x.to(torch.float64), y.to(torch.float64), grad_out.to(torch.float64)
    s = torch.sigmoid(x64)
    dx = g * y64 * s * (1 + x64 * (1 - s))
    return new_copy(dx, x.dtype), new_copy(g * x64 * s, y.dtype)


def _triton_refusal(call: SwiGLUCall) -> str | None:
    from tileport.ops.swiglu.triton_kernels import triton_refusal

    cap = capability_refusal(call.device_type, call.capability)
    if cap:
        return cap
    return triton_refusal(call.dtype)


def _cutile_refusal(call: SwiGLUCall) -> str | None:
    """Triton's dtype rules (the kernels take the same dtypes), on sm_90 or newer."""
    from tileport.ops.swiglu.triton_kernels import triton_refusal

    return capability_refusal(call.device_type, call.capability, (9, 0)) or triton_refusal(call.dtype)


DISPATCHER = register(
    OpDispatcher(
        "swiglu",
        [
            Backend("triton", triton_available("tileport.ops.swiglu.triton_kernels"), _triton_refusal,
                    lazy_stages("tileport.ops.swiglu.triton_kernels", "swiglu_forward_triton", "swiglu_backward_triton")),
            Backend("cutile", cutile_available("tileport.ops.swiglu.cutile_kernels"), _cutile_refusal,
                    lazy_stages("tileport.ops.swiglu.cutile_kernels", "swiglu_forward_cutile", "swiglu_backward_cutile")),
            reference_backend(_reference_forward, _reference_backward),
        ],
        signature=lambda call: call,
    )
)


def _forward_impl(x, y):
    if x.numel() == 0:
        return new_empty(x.shape, x.dtype, x.device)
    return DISPATCHER.choose(_describe(x), x.device.type).impl.forward(x, y)


def _backward_impl(grad_out, x, y):
    if x.numel() == 0:
        return torch.zeros_like(x), torch.zeros_like(y)
    return DISPATCHER.choose(_describe(x), x.device.type).impl.backward(grad_out.to(x.dtype), x, y)


@carries_forced_backends
class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return _forward_impl(x, y)

    @staticmethod
    def backward(ctx, grad_out):
        x, y = ctx.saved_tensors
        return _backward_impl(grad_out, x, y)


@torch.library.custom_op("tileport::swiglu_forward", mutates_args=())
def _swiglu_forward_op(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _forward_impl(x, y)


@_swiglu_forward_op.register_fake
def _(x, y):
    return x.new_empty(x.shape)


@torch.library.custom_op("tileport::swiglu_backward", mutates_args=())
def _swiglu_backward_op(grad_out: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                        forced: str) -> tuple[torch.Tensor, torch.Tensor]:
    with backends_forced_from(forced):  # the forward's forced backends (tileport.autograd_ops)
        return _backward_impl(grad_out, x, y)


@_swiglu_backward_op.register_fake
def _(grad_out, x, y, forced):
    return x.new_empty(x.shape), y.new_empty(y.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_out):
    x, y = ctx.saved_tensors
    return _swiglu_backward_op(grad_out, x, y, forced_backends_arg(ctx))


register_autograd("tileport::swiglu_forward", _backward, _setup_context)


def swiglu(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """silu(x) * y elementwise; x (gate) and y of one shape, dtype and device. Differentiable in both."""
    validate_swiglu_args(x, y)
    if torch.compiler.is_compiling():
        return _swiglu_forward_op(x, y)
    return _SwiGLUFunction.apply(x, y)


def explain_call(shape: str, dtype: torch.dtype, device_type: str, capability: tuple[int, int] | None) -> SwiGLUCall:
    """The call `tileport explain swiglu --shape M,D` describes (any shape: only dtype and device matter)."""
    try:
        [int(v) for v in shape.split(",")]
    except ValueError:
        raise ValueError(f"--shape for swiglu is comma-separated sizes (e.g. 8192,4096), got {shape!r}") from None
    return SwiGLUCall(dtype, device_type, capability)


__all__ = ["swiglu", "swiglu_reference", "DISPATCHER", "SwiGLUCall", "explain_call"]
