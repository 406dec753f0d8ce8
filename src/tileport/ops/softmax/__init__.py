"""Softmax over the last dimension: `softmax(x, dim=-1)`, as `torch.softmax(x, -1)` computes it.

    y = exp(x - max(x)) / sum(exp(x - max(x)))

Gradient for x: dx = y * (dy - sum(y * dy)), with y recomputed in fp32 from the saved input and
the forward's row statistics (max, 1/sum) (torch uses its rounded output instead, which costs bf16
gradients their precision on peaked rows). Math in fp32 (float64 on the reference); y in x's dtype. Runs through the torch.library custom ops
`tileport::softmax_forward` / `tileport::softmax_backward` under torch.compile (an
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
from tileport.cutile_support import cutile_available
from tileport.dispatch import Backend, OpDispatcher, capability_refusal, gluon_available, lazy_stages, reference_backend, register, triton_available
from tileport.memory import new_empty, new_copy
from tileport.validation import check_float_tensor
from tileport.ops.softmax.reference import softmax_reference


def validate_softmax_args(x, dim) -> None:
    check_float_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have shape [..., D] (at least 1 dimension), got a 0-d tensor")
    if x.shape[-1] == 0:
        raise ValueError("x has D = 0 (last dimension); D must be at least 1")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if dim not in (-1, x.dim() - 1):
        raise ValueError(f"dim must be the last dimension (-1 or {x.dim() - 1}) for x of rank {x.dim()}, got {dim}")


@dataclasses.dataclass(frozen=True)
class SoftmaxCall:
    D: int
    dtype: torch.dtype
    device_type: str
    capability: tuple[int, int] | None


def _describe(x) -> SoftmaxCall:
    cap = capability(x.device)
    return SoftmaxCall(x.shape[-1], x.dtype, x.device.type, cap)


def _reference_forward(x):
    x64 = x.to(torch.float64).reshape(-1, x.shape[-1])
    m = x64.max(dim=-1).values
    stats = torch.stack([m, 1.0 / torch.exp(x64 - m[:, None]).sum(-1)], dim=-1)
    return new_copy(softmax_reference(x), x.dtype), new_copy(stats, torch.float32)


def _reference_backward(grad_y, x, stats):
    y64 = softmax_reference(x)  # float64 from x itself (the statistics are for the kernels)
    dy = grad_y.to(torch.float64)
    return new_copy(y64 * (dy - (y64 * dy).sum(-1, keepdim=True)), x.dtype)


def _triton_refusal(call: SoftmaxCall) -> str | None:
    from tileport.ops.softmax.triton_kernels import triton_refusal

    cap = capability_refusal(call.device_type, call.capability)
    if cap:
        return cap
    return triton_refusal(call.D, call.dtype)


def _cutile_refusal(call: SoftmaxCall) -> str | None:
    """Triton's dtype rules (the kernels take the same dtypes), on sm_90 or newer."""
    from tileport.ops.softmax.triton_kernels import triton_refusal

    return capability_refusal(call.device_type, call.capability, (9, 0)) or triton_refusal(call.D, call.dtype)


def _gluon_refusal(call: SoftmaxCall) -> str | None:
    from tileport.ops.softmax.gluon_kernels import gluon_refusal

    if call.capability != (9, 0):
        return f"needs a Hopper GPU (sm_90), got {call.device_type} {call.capability}"
    # the backward with gluon_kernels.BACKWARD = "triton" and the forward and backward of rows
    # TMA cannot read are Triton's: its refusal applies
    return _triton_refusal(call) or gluon_refusal(call.D, call.dtype)


# Preference: gluon (forward and backward; gluon_kernels.BACKWARD), triton, cutile, then the float64
# reference. H200 (docs/perf/llm_ops.md row 7), bench at 366abfd, 8192 x 4096 bf16: the Gluon
# forward with rows inside warps 0.039 ms as a CUDA graph (81% of copy) and 0.057 eager, against
# Triton's 0.054 and 0.058 (row 3's Gluon kernel had been 0.047 and a noisy 0.128 eager, so Triton
# was first until then). cuTile's forward: 0.193 / 0.198.
DISPATCHER = register(
    OpDispatcher(
        "softmax",
        [
            Backend("gluon", gluon_available("tileport.ops.softmax.gluon_kernels"), _gluon_refusal,
                    lazy_stages("tileport.ops.softmax.gluon_kernels", "softmax_forward_gluon", "softmax_backward_gluon")),
            Backend("triton", triton_available("tileport.ops.softmax.triton_kernels"), _triton_refusal,
                    lazy_stages("tileport.ops.softmax.triton_kernels", "softmax_forward_triton", "softmax_backward_triton")),
            Backend("cutile", cutile_available("tileport.ops.softmax.cutile_kernels"), _cutile_refusal,
                    lazy_stages("tileport.ops.softmax.cutile_kernels", "softmax_forward_cutile", "softmax_backward_cutile")),
            reference_backend(_reference_forward, _reference_backward),
        ],
        signature=lambda call: call,
    )
)


def _stats_shape(x) -> tuple[int, int]:
    # (max, 1/sum) per row in fp32; a one-row placeholder for an empty x (torch 2.11 rejects
    # zero-size CUDA custom-op outputs)
    return (max(1, x.numel() // x.shape[-1]), 2)


def _forward_impl(x):
    """(y, row statistics [rows, 2] fp32)."""
    if x.numel() == 0:
        return new_empty(x.shape, x.dtype, x.device), torch.zeros(_stats_shape(x), dtype=torch.float32, device=x.device)
    return DISPATCHER.choose(_describe(x), x.device.type).impl.forward(x)


def _backward_impl(grad_y, x, stats):
    if x.numel() == 0:
        return torch.zeros_like(x)
    return DISPATCHER.choose(_describe(x), x.device.type).impl.backward(grad_y.to(x.dtype), x, stats)


@carries_forced_backends
class _SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y, stats = _forward_impl(x)
        ctx.save_for_backward(x, stats)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, stats = ctx.saved_tensors
        return _backward_impl(grad_y, x, stats)


@torch.library.custom_op("tileport::softmax_forward", mutates_args=())
def _softmax_forward_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_impl(x)


@_softmax_forward_op.register_fake
def _(x):
    return x.new_empty(x.shape), x.new_empty(_stats_shape(x), dtype=torch.float32)


@torch.library.custom_op("tileport::softmax_backward", mutates_args=())
def _softmax_backward_op(grad_y: torch.Tensor, x: torch.Tensor, stats: torch.Tensor, forced: str) -> torch.Tensor:
    with backends_forced_from(forced):  # the forward's forced backends (tileport.autograd_ops)
        return _backward_impl(grad_y, x, stats)


@_softmax_backward_op.register_fake
def _(grad_y, x, stats, forced):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])
    ctx.set_materialize_grads(True)


def _backward(ctx, grad_y, grad_stats):
    # stats is an internal output: it carries no gradient
    x, stats = ctx.saved_tensors
    return _softmax_backward_op(grad_y, x, stats, forced_backends_arg(ctx))


register_autograd("tileport::softmax_forward", _backward, _setup_context)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax over the last dimension of `x [..., D]`; y in x's dtype, differentiable in x.

    `dim` must name the last dimension (-1 or x.dim() - 1): other dims are not supported.
    """
    validate_softmax_args(x, dim)
    if torch.compiler.is_compiling():
        return _softmax_forward_op(x)[0]
    return _SoftmaxFunction.apply(x)


def explain_call(shape: str, dtype: torch.dtype, device_type: str, capability: tuple[int, int] | None) -> SoftmaxCall:
    """The call `tileport explain softmax --shape M,D` describes."""
    try:
        _M, D = (int(v) for v in shape.split(","))
    except ValueError:
        raise ValueError(f"--shape for softmax is M,D (e.g. 8192,4096), got {shape!r}") from None
    return SoftmaxCall(D, dtype, device_type, capability)


__all__ = ["softmax", "softmax_reference", "DISPATCHER", "SoftmaxCall", "explain_call"]
