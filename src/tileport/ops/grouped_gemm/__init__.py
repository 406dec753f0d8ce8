"""Grouped GEMM: `grouped_gemm(a, b) = [a_i @ b_i]` for G problems of different M, one K and N.

    a: sequence of G tensors [M_i, K] (M_i may be 0);  b: sequence of G tensors [K, N], or one [G, K, N]
    returns [c_i [M_i, N]] in the input dtype (views of one [sum M_i, N] buffer)

Gradients for every a_i and b_i (the same grouped kernel, operands transposed by strides).
Accumulation in fp32 (fp32 inputs multiply in full fp32, no tf32). Runs through the torch.library
custom ops `tileport::grouped_gemm_forward` / `tileport::grouped_gemm_backward` under
torch.compile (an autograd.Function in eager mode); backends, in this order:

    gluon      (Hopper, 16-bit) the forward on a persistent pipelined TMA + WGMMA kernel, the
               backward Triton's; gluon_kernels.py
    triton     one grouped launch per direction (tensor descriptors on sm_90), triton_kernels.py
    cutile     cuda.tile kernels (16-bit inputs), one launch per direction over slices of the
               stacked operands; compiled for sm_90 in CI, run on the H200, cutile_kernels.py
    reference  float64 PyTorch, the contract, reference.py
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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
from tileport.ops.grouped_gemm.reference import grouped_gemm_reference
from tileport.validation import check_float_tensor


def _as_list(name: str, seq) -> list:
    if isinstance(seq, torch.Tensor) or not isinstance(seq, Sequence):
        raise TypeError(f"{name} must be a non-empty sequence (list or tuple) of tensors, got {type(seq).__name__}")
    if len(seq) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of tensors, got an empty sequence")
    return list(seq)


def validate_grouped_gemm_args(a, b) -> tuple[list, list]:
    """(a as a list, b as a list); raises naming the argument."""
    a = _as_list("a", a)
    first = a[0]
    check_float_tensor("a[0]", first)
    if first.dim() != 2:
        raise ValueError(f"a[0] must have shape [M, K] (rank 2), got {tuple(first.shape)}")
    K = first.shape[1]
    for i, x in enumerate(a):
        if i:
            check_float_tensor(f"a[{i}]", x, first.device, device_of="a[0]")
            if x.dtype != first.dtype:
                raise TypeError(f"a[{i}] has dtype {x.dtype} but a[0] has {first.dtype}; all operands share one dtype")
            if x.dim() != 2 or x.shape[1] != K:
                raise ValueError(f"a[{i}] must have shape [M_{i}, K] with K = {K}, got {tuple(x.shape)}")
    if isinstance(b, torch.Tensor):
        check_float_tensor("b", b, first.device, device_of="a[0]")
        if b.dim() != 3 or b.shape[0] != len(a) or b.shape[1] != K:
            raise ValueError(f"b as one tensor must have shape [G, K, N] = [{len(a)}, {K}, N], got {tuple(b.shape)}")
        if b.dtype != first.dtype:
            raise TypeError(f"b has dtype {b.dtype} but a has {first.dtype}; all operands share one dtype")
        return a, list(b.unbind(0))
    b = _as_list("b", b)
    if len(b) != len(a):
        raise ValueError(f"b has {len(b)} matrices but a has {len(a)}; one b_i per a_i")
    N = None
    for i, w in enumerate(b):
        check_float_tensor(f"b[{i}]", w, first.device, device_of="a[0]")
        if w.dtype != first.dtype:
            raise TypeError(f"b[{i}] has dtype {w.dtype} but a[0] has {first.dtype}; all operands share one dtype")
        if w.dim() != 2 or w.shape[0] != K:
            raise ValueError(f"b[{i}] must have shape [K, N] with K = {K} (a's last dim), got {tuple(w.shape)}")
        N = w.shape[1] if N is None else N
        if w.shape[1] != N:
            raise ValueError(f"b[{i}] has N = {w.shape[1]} but b[0] has N = {N}; all problems share one N")
    return a, b


@dataclasses.dataclass(frozen=True)
class GroupedGemmCall:
    K: int
    N: int
    dtype: torch.dtype
    b_dtype: torch.dtype
    device_type: str
    capability: tuple[int, int] | None


def _describe(a, b) -> GroupedGemmCall:
    x = a[0]
    cap = capability(x.device)
    return GroupedGemmCall(x.shape[1], b[0].shape[1], x.dtype, b[0].dtype, x.device.type, cap)


def _reference_forward(a, b):
    return new_copy(torch.cat(grouped_gemm_reference(a, b)), a[0].dtype)


def _reference_backward(grad_c, a, b, want_da, want_db):
    dcs = grad_c.to(torch.float64).split([x.shape[0] for x in a])
    da = new_copy(torch.cat([dc @ w.to(torch.float64).T for dc, w in zip(dcs, b)]), a[0].dtype) if want_da else None
    db = new_copy(torch.stack([x.to(torch.float64).T @ dc for x, dc in zip(a, dcs)]), b[0].dtype) if want_db else None
    return da, db


def _triton_refusal(call: GroupedGemmCall) -> str | None:
    from tileport.ops.grouped_gemm.triton_kernels import triton_refusal

    cap = capability_refusal(call.device_type, call.capability)
    if cap:
        return cap
    return triton_refusal(call.dtype, call.b_dtype)


def _cutile_refusal(call: GroupedGemmCall) -> str | None:
    from tileport.ops.grouped_gemm.cutile_kernels import cutile_refusal

    return capability_refusal(call.device_type, call.capability, (9, 0)) or cutile_refusal(call.dtype, call.b_dtype)


def _gluon_refusal(call: GroupedGemmCall) -> str | None:
    from tileport.ops.grouped_gemm.gluon_kernels import gluon_refusal

    if call.capability != (9, 0):
        return f"needs a Hopper GPU (sm_90), got {call.device_type} {call.capability}"
    # the backward (and the forward of operands TMA cannot read) is Triton's
    return _triton_refusal(call) or gluon_refusal(call.dtype, call.b_dtype)


# Preference: gluon (16-bit forward; the backward is Triton's), triton, cutile, then the float64
# reference. H200, bench at 26c97d1 (one run, G=8, M=2048, K=N=4096 bf16): forward 0.973 ms against
# Triton's 1.049 and cuTile's 1.268 (14963d1); docs/perf/llm_ops.md row 4.
DISPATCHER = register(
    OpDispatcher(
        "grouped_gemm",
        [
            Backend("gluon", gluon_available("tileport.ops.grouped_gemm.gluon_kernels"), _gluon_refusal,
                    lazy_stages("tileport.ops.grouped_gemm.gluon_kernels", "grouped_gemm_forward_gluon",
                                "grouped_gemm_backward_gluon")),
            Backend("triton", triton_available("tileport.ops.grouped_gemm.triton_kernels"), _triton_refusal,
                    lazy_stages("tileport.ops.grouped_gemm.triton_kernels", "grouped_gemm_forward_triton",
                          "grouped_gemm_backward_triton")),
            Backend("cutile", cutile_available("tileport.ops.grouped_gemm.cutile_kernels"), _cutile_refusal,
                    lazy_stages("tileport.ops.grouped_gemm.cutile_kernels", "grouped_gemm_forward_cutile",
                                "grouped_gemm_backward_cutile")),
            reference_backend(_reference_forward, _reference_backward),
        ],
        signature=lambda call: call,
    )
)


def _contig(ts):
    return [t if t.is_contiguous() else t.contiguous() for t in ts]


def _forward_impl(a, b):
    """c stacked [sum M_i, N]."""
    a, b = _contig(a), _contig(b)
    total, N = sum(x.shape[0] for x in a), b[0].shape[1]
    if total == 0 or N == 0 or a[0].shape[1] == 0:
        c = new_empty((total, N), a[0].dtype, a[0].device)
        return c.zero_() if total * N else c
    return DISPATCHER.choose(_describe(a, b), a[0].device.type).impl.forward(a, b)


def _backward_impl(grad_c, a, b, want_da, want_db):
    """(da stacked [sum M_i, K] or None, db [G, K, N] or None)."""
    a, b = _contig(a), _contig(b)
    K, N = b[0].shape
    total = sum(x.shape[0] for x in a)
    if total == 0 or N == 0 or K == 0:
        da = torch.zeros((total, K), dtype=a[0].dtype, device=a[0].device) if want_da else None
        db = torch.zeros((len(b), K, N), dtype=b[0].dtype, device=b[0].device) if want_db else None
        return da, db
    g = grad_c.to(a[0].dtype).contiguous()
    return DISPATCHER.choose(_describe(a, b), a[0].device.type).impl.backward(g, a, b, want_da, want_db)


@carries_forced_backends
class _GroupedGemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, G, *ab):
        a, b = list(ab[:G]), list(ab[G:])
        ctx.G = G
        ctx.save_for_backward(*ab)
        return _forward_impl(a, b)

    @staticmethod
    def backward(ctx, grad_c):
        G = ctx.G
        saved = ctx.saved_tensors
        a, b = list(saved[:G]), list(saved[G:])
        want_da = any(ctx.needs_input_grad[1:1 + G])
        want_db = any(ctx.needs_input_grad[1 + G:])
        da, db = _backward_impl(grad_c, a, b, want_da, want_db)
        das = list(da.split([x.shape[0] for x in a])) if da is not None else [None] * G
        dbs = list(db.unbind(0)) if db is not None else [None] * G
        return (None, *das, *dbs)


@torch.library.custom_op("tileport::grouped_gemm_forward", mutates_args=())
def _grouped_gemm_forward_op(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    return _forward_impl(a, b)


@_grouped_gemm_forward_op.register_fake
def _(a, b):
    return a[0].new_empty((sum(x.shape[0] for x in a), b[0].shape[1]))


@torch.library.custom_op("tileport::grouped_gemm_backward", mutates_args=())
def _grouped_gemm_backward_op(grad_c: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor],
                              want_da: bool, want_db: bool, forced: str) -> tuple[torch.Tensor, torch.Tensor]:
    with backends_forced_from(forced):  # the forward's forced backends (tileport.autograd_ops)
        da, db = _backward_impl(grad_c, a, b, want_da, want_db)
    # placeholders (one element: torch 2.11 rejects zero-size CUDA custom-op outputs)
    return (da if da is not None else grad_c.new_zeros(1)), (db if db is not None else grad_c.new_zeros(1))


@_grouped_gemm_backward_op.register_fake
def _(grad_c, a, b, want_da, want_db, forced):
    K, N = b[0].shape
    da = a[0].new_empty((sum(x.shape[0] for x in a), K)) if want_da else grad_c.new_empty(1)
    db = b[0].new_empty((len(b), K, N)) if want_db else grad_c.new_empty(1)
    return da, db


def _setup_context(ctx, inputs, output):
    a, b = inputs
    ctx.G = len(a)
    ctx.save_for_backward(*a, *b)


def _backward(ctx, grad_c):
    G = ctx.G
    saved = ctx.saved_tensors
    a, b = list(saved[:G]), list(saved[G:])
    want_da, want_db = (bool(any(n)) if isinstance(n, (list, tuple)) else bool(n) for n in ctx.needs_input_grad[:2])
    da, db = _grouped_gemm_backward_op(grad_c, a, b, want_da, want_db, forced_backends_arg(ctx))
    das = list(da.split([x.shape[0] for x in a])) if want_da else None
    dbs = list(db.unbind(0)) if want_db else None
    return das, dbs


register_autograd("tileport::grouped_gemm_forward", _backward, _setup_context)


def grouped_gemm_stacked(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """The products stacked: [sum M_i, N], rows of c_0 first (what `grouped_gemm` splits)."""
    a, b = validate_grouped_gemm_args(a, b)
    if torch.compiler.is_compiling():
        return _grouped_gemm_forward_op(a, b)
    return _GroupedGemmFunction.apply(len(a), *a, *b)


def grouped_gemm(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    """[a_i @ b_i for each group]: a_i [M_i, K] (M_i may differ, or be 0), b_i [K, N] (a list, or
    one [G, K, N] tensor). Outputs [M_i, N] in the input dtype; differentiable in a and b."""
    c = grouped_gemm_stacked(a, b)
    return list(c.split([x.shape[0] for x in a]))


def explain_call(shape: str, dtype: torch.dtype, device_type: str, capability: tuple[int, int] | None) -> GroupedGemmCall:
    """The call `tileport explain grouped_gemm --shape G,M,K,N` describes."""
    try:
        _G, _M, K, N = (int(v) for v in shape.split(","))
    except ValueError:
        raise ValueError(f"--shape for grouped_gemm is G,M,K,N (e.g. 8,2048,4096,4096), got {shape!r}") from None
    return GroupedGemmCall(K, N, dtype, dtype, device_type, capability)


__all__ = ["grouped_gemm", "grouped_gemm_stacked", "grouped_gemm_reference", "DISPATCHER", "GroupedGemmCall",
           "explain_call"]
