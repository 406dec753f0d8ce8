"""The op plumbing shared by the delta-rule ops (GDN, KDA): their backends and dispatcher, custom
ops, fake impls, autograd, and the call after validation. The two ops differ only in their gate's
shape, in the kernels behind each backend and in which backends keep forward intermediates for
their backward (KDA's), so `delta_rule_op` builds both from the op's name (kernels in
`tileport.ops.<op>.triton_kernels` / `.gluon_kernels`, `<op>_forward_triton` and so on), its float64
reference and its keeping backends.

Schema, for both `tileport::<op>_forward` and `tileport::<op>_backward`:
    forward(q, k, v, g, beta, initial_state?, cu_seqlens?, scale, output_final_state, use_l2) -> (o, ht)
    backward(do, dht?, q, k, v, g, beta, initial_state?, cu_seqlens?, scale, use_l2, forced) -> [dq, dk, dv, dg, dbeta, dh0]
`forced`: the forward's forced backends (`autograd_ops.forced_backends_arg`), under which the
backward dispatches (it runs on autograd's device thread, where the caller's are absent); under
torch.compile those in force when the graph was traced (see tileport.autograd_ops).
`ht` and `dh0` are one-element placeholders when absent (one, not zero elements: torch 2.11's
custom-op aliasing check rejected zero-size CUDA outputs, seen with AttnRes on the H200).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import NamedTuple

import torch

from tileport.autograd_ops import backends_forced_from, eager_function, forced_backends_arg, register_autograd
from tileport.devices import capability
from tileport.dispatch import (Backend, OpDispatcher, gluon_available, kernel_dtype_and_capability_refusal,
                               lazy_stages, reference_backend, register, triton_available)
from tileport.memory import new_copy


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """States are fp32 (float64 on the float64 reference path)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _num_seqs(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1


def make_delta_rule_op(op: str, forward_backend: Callable, backward_backend: Callable,
                       keeping_backends: tuple[str, ...] = ()) -> Callable:
    """Build the custom ops and the eager autograd.Function for `op`; return
    run(q, k, v, g, beta, scale, initial_state, output_final_state, use_l2, cu_seqlens) -> (o, ht or None)
    for validated arguments. `forward_backend(q, v)` / `backward_backend(q, v)` return the Backend.
    keeping_backends: the backends whose forward, asked with keep_for_backward=True, also returns
    what their backward takes back as `kept=` instead of recomputing it (KDA's stage 3, and on its gluon
    backend stage 5's states). They are
    asked in eager mode when autograd will differentiate the call; under torch.compile the
    backward recomputes (a custom op returns only its schema's outputs)."""

    def run_forward(backend, q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state,
                    use_qk_l2norm_in_kernel, keep: bool):
        """((o, ht), what the backend kept or None): ht a one-element placeholder when not asked for."""
        args = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
        if keep:
            o, ht, kept = backend.impl.forward(*args, keep_for_backward=True)
        else:
            (o, ht), kept = backend.impl.forward(*args), None
        if ht is None:
            ht = q.new_empty((1,), dtype=state_dtype(q.dtype))
        return (o, ht), kept

    def run_backward(backend, grad_o, grad_final_state, q, k, v, g, beta, initial_state, cu_seqlens, scale,
                     use_qk_l2norm_in_kernel, kept=None) -> list[torch.Tensor]:
        """[dq, dk, dv, dg, dbeta, dh0] from backend (kept: what its forward kept, or None); dh0 a
        one-element placeholder without an initial state."""
        extra = {} if kept is None else {"kept": kept}
        dq, dk, dv, dg, dbeta, dh0 = backend.impl.backward(
            grad_o.to(q.dtype), grad_final_state, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
            cu_seqlens, **extra)
        if dh0 is None:
            dh0 = q.new_zeros((1,))
        return [dq, dk, dv, dg, dbeta, dh0]

    def forward_body(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float,
                     output_final_state: bool, use_qk_l2norm_in_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return run_forward(forward_backend(q, v), q, k, v, g, beta, initial_state, cu_seqlens, scale,
                           output_final_state, use_qk_l2norm_in_kernel, keep=False)[0]

    def backward_body(grad_o: torch.Tensor, grad_final_state: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None,
                      cu_seqlens: torch.Tensor | None, scale: float,
                      use_qk_l2norm_in_kernel: bool, forced: str) -> list[torch.Tensor]:
        with backends_forced_from(forced):
            return run_backward(backward_backend(q, v), grad_o, grad_final_state, q, k, v, g, beta, initial_state,
                                cu_seqlens, scale, use_qk_l2norm_in_kernel)

    def forward_body_keeping(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state,
                             use_qk_l2norm_in_kernel):
        """((o, ht), (backend name, what it kept) or None): the eager forward autograd will
        differentiate, where a keeping backend is asked to keep what its backward reuses."""
        backend = forward_backend(q, v)
        out, kept = run_forward(backend, q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state,
                                use_qk_l2norm_in_kernel, keep=backend.name in keeping_backends)
        return out, (None if kept is None else (backend.name, kept))

    forward_op = torch.library.custom_op(f"tileport::{op}_forward", forward_body, mutates_args=())
    backward_op = torch.library.custom_op(f"tileport::{op}_backward", backward_body, mutates_args=())

    @forward_op.register_fake
    def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm_in_kernel):
        B, T, H, K = q.shape
        V = v.shape[-1]
        ht_shape = (_num_seqs(q, cu_seqlens), H, K, V) if output_final_state else (1,)
        return q.new_empty((B, T, H, V)), q.new_empty(ht_shape, dtype=state_dtype(q.dtype))

    @backward_op.register_fake
    def _(grad_o, grad_final_state, q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel,
          forced):
        dh0 = initial_state.new_empty(initial_state.shape) if initial_state is not None else q.new_empty((1,))
        return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
                beta.new_empty(beta.shape), dh0]

    def setup_context(ctx, inputs, output):
        q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_l2 = inputs
        ctx.scale, ctx.output_final_state, ctx.use_l2 = scale, output_final_state, use_l2
        ctx.has_h0, ctx.has_cu = initial_state is not None, cu_seqlens is not None
        saved = [q, k, v, g, beta]
        if initial_state is not None:
            saved.append(initial_state)
        if cu_seqlens is not None:
            saved.append(cu_seqlens)
        # what the eager keeping forward kept (eager_function(keeps=True) sets ctx.kept first): saved
        # like the inputs, so that autograd frees it after the backward and saved-tensor hooks
        # (checkpointing, offloading) see it; ctx keeps only its backend's name and its type
        kept, ctx.kept = getattr(ctx, "kept", None), None
        if kept is not None:
            ctx.kept_backend, ctx.kept_type = kept[0], type(kept[1])
            saved.extend(kept[1])
        ctx.save_for_backward(*saved)

    def backward(ctx, grad_o, grad_final_state, backward_op=backward_op):
        # backward_op: the custom op under compile (registered below), the body in eager mode
        saved = list(ctx.saved_tensors)
        q, k, v, g, beta = saved[:5]
        rest = saved[5:]
        initial_state = rest.pop(0) if ctx.has_h0 else None
        cu_seqlens = rest.pop(0) if ctx.has_cu else None
        if not ctx.output_final_state:
            grad_final_state = None  # the placeholder's gradient
        if getattr(ctx, "kept_backend", None) is not None:  # the eager keeping path: rest is what was kept
            backend = backward_backend(q, v)
            # handed back only to the backend that kept it (one forced for the backward alone recomputes)
            kept = ctx.kept_type(*rest) if backend.name == ctx.kept_backend else None
            dq, dk, dv, dg, dbeta, dh0 = run_backward(backend, grad_o, grad_final_state, q, k, v, g, beta,
                                                      initial_state, cu_seqlens, ctx.scale, ctx.use_l2, kept)
        else:
            dq, dk, dv, dg, dbeta, dh0 = backward_op(grad_o, grad_final_state, q, k, v, g, beta, initial_state,
                                                     cu_seqlens, ctx.scale, ctx.use_l2, forced_backends_arg(ctx))
        return dq, dk, dv, dg, dbeta, (dh0 if ctx.has_h0 else None), None, None, None, None

    register_autograd(f"tileport::{op}_forward", backward, setup_context)
    eager = eager_function(f"_{op.upper()}Function", forward_body, backward_body, setup_context, backward)
    eager_keeping = (eager_function(f"_{op.upper()}KeepingFunction", forward_body_keeping, backward_body,
                                    setup_context, backward, keeps=True) if keeping_backends else eager)

    def run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
        B, T, H, K = q.shape
        if B * T == 0:  # no steps: o is empty and the final state is the initial one (plain torch)
            o = v.new_empty((B, T, H, v.shape[-1]))
            if not output_final_state:
                return o, None
            sdt = state_dtype(q.dtype)
            if initial_state is None:
                return o, q.new_zeros((_num_seqs(q, cu_seqlens), H, K, v.shape[-1]), dtype=sdt)
            return o, initial_state.to(sdt, copy=True)
        if torch.compiler.is_compiling():
            call = forward_op
        elif torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                             for t in (q, k, v, g, beta, initial_state)):
            call = eager_keeping.apply  # autograd will differentiate it: the backend may keep stage results
        else:
            call = eager.apply
        o, ht = call(q, k, v, g, beta, initial_state, cu_seqlens, float(scale), output_final_state,
                     use_qk_l2norm_in_kernel)
        return o, (ht if output_final_state else None)

    return run


@dataclasses.dataclass(frozen=True)
class DeltaRuleCall:
    """What a delta-rule op's backends decide on. Built once per call; hashable, so decisions are
    cached on it."""

    K: int
    V: int
    dtype: torch.dtype
    device_type: str
    capability: tuple[int, int] | None


def describe_call(q: torch.Tensor, v: torch.Tensor) -> DeltaRuleCall:
    return DeltaRuleCall(q.shape[-1], v.shape[-1], q.dtype, q.device.type, capability(q.device))


def explain_call_of(op: str, shape: str, dtype: torch.dtype, device_type: str,
                    cap: tuple[int, int] | None) -> DeltaRuleCall:
    """The call `tileport explain <op> --shape B,T,H,K,V` describes."""
    try:
        _B, _T, _H, K, V = (int(x) for x in shape.split(","))
    except ValueError:
        raise ValueError(f"--shape for {op} is B,T,H,K,V (e.g. 8,4096,16,128,128), got {shape!r}") from None
    return DeltaRuleCall(K, V, dtype, device_type, cap)


class DeltaRuleOp(NamedTuple):
    dispatcher: OpDispatcher
    triton_refusal: Callable  # (DeltaRuleCall) -> reason or None
    run: Callable  # make_delta_rule_op's runner


def delta_rule_op(op: str, reference: Callable, recurrent_backward: Callable,
                  keeping_backends: tuple[str, ...] = ()) -> DeltaRuleOp:
    """The dispatcher (registered as `op`) and the runner of a delta-rule op, from its float64
    `reference(q, k, v, g, beta, scale, h0, output_final_state, use_l2, cu_seqlens)` and closed-form
    `recurrent_backward(do, dht, ...)`. Preference: gluon (Hopper; Triton's stages with some on Gluon
    kernels, so it refuses what Triton refuses and what its own kernels do), then triton, then the
    float64 reference. Each backend computes its own forward's gradients (every one has a backward)."""
    package = f"tileport.ops.{op}"

    def reference_forward(q, k, v, g, beta, scale, initial_state, output_final_state, use_l2, cu_seqlens):
        o, ht = reference(q, k, v, g, beta, scale, initial_state, output_final_state, use_l2, cu_seqlens)
        return new_copy(o, q.dtype), (new_copy(ht, state_dtype(q.dtype)) if ht is not None else None)

    def reference_backward(do, dht, q, k, v, g, beta, scale, initial_state, use_l2, cu_seqlens):
        # The closed-form reverse sweep in float64 (autograd is switched off inside a custom op's
        # body). The parity tests check it, like every backend, against autograd through the reference.
        dq, dk, dv, dg, dbeta, dh0 = recurrent_backward(do, dht, q, k, v, g, beta, scale, initial_state, use_l2,
                                                        cu_seqlens)
        return (new_copy(dq, q.dtype), new_copy(dk, k.dtype), new_copy(dv, v.dtype), new_copy(dg, g.dtype),
                new_copy(dbeta, beta.dtype), new_copy(dh0, initial_state.dtype) if dh0 is not None else None)

    def triton_refusal(call: DeltaRuleCall) -> str | None:
        common = kernel_dtype_and_capability_refusal(call.dtype, call.device_type, call.capability)
        if common:
            return common
        return importlib.import_module(f"{package}.triton_kernels").triton_refusal(call.K, call.V, call.dtype)

    def gluon_refusal(call: DeltaRuleCall) -> str | None:
        if call.capability != (9, 0):
            return f"needs a Hopper GPU (sm_90), got {call.device_type} {call.capability}"
        # Triton's stages run beside the Gluon kernels: what Triton refuses, this backend refuses too
        return triton_refusal(call) or importlib.import_module(f"{package}.gluon_kernels").gluon_refusal(
            call.K, call.V, call.dtype)

    dispatcher = register(
        OpDispatcher(
            op,
            [
                Backend("gluon", gluon_available(f"{package}.gluon_kernels"), gluon_refusal,
                        lazy_stages(f"{package}.gluon_kernels", f"{op}_forward_gluon", f"{op}_backward_gluon")),
                Backend("triton", triton_available(f"{package}.triton_kernels"), triton_refusal,
                        lazy_stages(f"{package}.triton_kernels", f"{op}_forward_triton", f"{op}_backward_triton")),
                reference_backend(reference_forward, reference_backward),
            ],
            signature=lambda call: call,
        )
    )

    def backend_for(q: torch.Tensor, v: torch.Tensor) -> Backend:
        return dispatcher.choose(describe_call(q, v), q.device.type)

    return DeltaRuleOp(dispatcher, triton_refusal, make_delta_rule_op(op, backend_for, backend_for, keeping_backends))
