"""Rotary position embedding, rotate-half form: `rope(x, cos, sin)`.

    y = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

x `[B, T, H, D]` (D even); cos, sin `[T, D]`, broadcast over B and H (the HF/Llama convention:
cos = cat(cos(t f), cos(t f)), but any [T, D] values are honoured). Gradient for x; cos and sin
are constants (an error if they require grad). Math in fp32 (float64 on the reference); y in x's
dtype. Runs through the torch.library custom ops `tileport::rope_forward` / `tileport::rope_backward`
under torch.compile (an autograd.Function in eager mode); backends:

    triton     one kernel for both directions (tensor descriptors on sm_90), triton_kernels.py
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
from tileport.ops.rope.reference import rope_reference, rotate_half


def validate_rope_args(x, cos, sin) -> None:
    check_float_tensor("x", x)
    if x.dim() != 4:
        raise ValueError(f"x must have shape [B, T, H, D] (rank 4), got rank {x.dim()} {tuple(x.shape)}")
    _B, T, _H, D = x.shape
    if D == 0 or D % 2:
        raise ValueError(f"x's head dim D must be even and positive (rotate-half splits it in two), got D = {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_float_tensor(name, t, x.device)
        if tuple(t.shape) != (T, D):
            raise ValueError(f"{name} must have shape [T, D] = [{T}, {D}] (x is {tuple(x.shape)}), got {tuple(t.shape)}")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad, but rope treats cos and sin as constants (no gradient "
                             f"flows to them); pass {name}.detach()")


@dataclasses.dataclass(frozen=True)
class RopeCall:
    D: int
    dtype: torch.dtype
    cos_dtype: torch.dtype
    device_type: str
    capability: tuple[int, int] | None


def _describe(x, cos) -> RopeCall:
    cap = capability(x.device)
    return RopeCall(x.shape[-1], x.dtype, cos.dtype, x.device.type, cap)


def _reference_forward(x, cos, sin):
    return new_copy(rope_reference(x, cos, sin), x.dtype)


def _reference_backward(grad_y, cos, sin):
    # The transpose of x -> x*cos + rotate_half(x)*sin: g*cos + rotate_half^T(g*sin), with
    # rotate_half^T(u) = cat(u2, -u1) = -rotate_half(u).
    g = grad_y.to(torch.float64)
    c = cos.to(torch.float64)[None, :, None, :]
    s = sin.to(torch.float64)[None, :, None, :]
    return new_copy(g * c - rotate_half(g * s), grad_y.dtype)


def _triton_refusal(call: RopeCall) -> str | None:
    from tileport.ops.rope.triton_kernels import triton_refusal

    cap = capability_refusal(call.device_type, call.capability)
    if cap:
        return cap
    return triton_refusal(call.D, call.dtype, call.cos_dtype)


def _cutile_refusal(call: RopeCall) -> str | None:
    """Triton's dtype rules (the kernels take the same dtypes), on sm_90 or newer."""
    from tileport.ops.rope.triton_kernels import triton_refusal

    return capability_refusal(call.device_type, call.capability, (9, 0)) or triton_refusal(call.D, call.dtype, call.cos_dtype)


DISPATCHER = register(
    OpDispatcher(
        "rope",
        [
            Backend("triton", triton_available("tileport.ops.rope.triton_kernels"), _triton_refusal,
                    lazy_stages("tileport.ops.rope.triton_kernels", "rope_forward_triton", "rope_backward_triton")),
            Backend("cutile", cutile_available("tileport.ops.rope.cutile_kernels"), _cutile_refusal,
                    lazy_stages("tileport.ops.rope.cutile_kernels", "rope_forward_cutile", "rope_backward_cutile")),
            reference_backend(_reference_forward, _reference_backward),
        ],
        signature=lambda call: call,
    )
)


def _forward_impl(x, cos, sin):
    if x.numel() == 0:
        return new_empty(x.shape, x.dtype, x.device)
    return DISPATCHER.choose(_describe(x, cos), x.device.type).impl.forward(x, cos, sin)


def _backward_impl(grad_y, cos, sin, dtype):
    if grad_y.numel() == 0:
        return torch.zeros(grad_y.shape, dtype=dtype, device=grad_y.device)
    g = grad_y.to(dtype)
    return DISPATCHER.choose(_describe(g, cos), g.device.type).impl.backward(g, cos, sin)


@carries_forced_backends
class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _forward_impl(x, cos, sin)

    @staticmethod
    def backward(ctx, grad_y):
        cos, sin = ctx.saved_tensors
        return _backward_impl(grad_y, cos, sin, ctx.x_dtype), None, None


@torch.library.custom_op("tileport::rope_forward", mutates_args=())
def _rope_forward_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _forward_impl(x, cos, sin)


@_rope_forward_op.register_fake
def _(x, cos, sin):
    return x.new_empty(x.shape)


@torch.library.custom_op("tileport::rope_backward", mutates_args=())
def _rope_backward_op(grad_y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype,
                      forced: str) -> torch.Tensor:
    with backends_forced_from(forced):  # the forward's forced backends (tileport.autograd_ops)
        return _backward_impl(grad_y, cos, sin, dtype)


@_rope_backward_op.register_fake
def _(grad_y, cos, sin, dtype, forced):
    return grad_y.new_empty(grad_y.shape, dtype=dtype)


def _setup_context(ctx, inputs, output):
    x, cos, sin = inputs
    ctx.save_for_backward(cos, sin)
    ctx.x_dtype = x.dtype


def _backward(ctx, grad_y):
    cos, sin = ctx.saved_tensors
    return _rope_backward_op(grad_y, cos, sin, ctx.x_dtype, forced_backends_arg(ctx)), None, None


register_autograd("tileport::rope_forward", _backward, _setup_context)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary embeddings (rotate-half form) to `x [B, T, H, D]` with `cos, sin [T, D]`.

    Returns y `[B, T, H, D]` (contiguous) in x's dtype; differentiable in x. x may be a strided
    view (e.g. q out of a fused qkv tensor): it is read in place.
    """
    validate_rope_args(x, cos, sin)
    if torch.compiler.is_compiling():
        return _rope_forward_op(x, cos, sin)
    return _RopeFunction.apply(x, cos, sin)


def explain_call(shape: str, dtype: torch.dtype, device_type: str, capability: tuple[int, int] | None) -> RopeCall:
    """The call `tileport explain rope --shape B,T,H,D` describes (float32 cos/sin)."""
    try:
        _B, _T, _H, D = (int(v) for v in shape.split(","))
    except ValueError:
        raise ValueError(f"--shape for rope is B,T,H,D (e.g. 8,4096,32,128), got {shape!r}") from None
    return RopeCall(D, dtype, torch.float32, device_type, capability)


__all__ = ["rope", "rope_reference", "DISPATCHER", "RopeCall", "explain_call"]
