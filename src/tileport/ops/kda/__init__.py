"""Kimi Delta Attention: `chunk_kda`, as `fla.ops.kda.chunk_kda` computes it.

KDA is Gated DeltaNet with a decay per key channel. Per sequence and head, with state S (K x V,
fp32) starting from `initial_state` or zeros, and g_t in R^K:

    S = diag(exp(g_t)) S;   u_t = beta_t (v_t - S^T k_t);   S = S + k_t u_t^T;   o_t = S^T (scale q_t)

Public entry point: `chunk_kda` (GDN's signature; g is [B, T, H, K]). The call is validated here,
then runs through the torch.library custom ops `tileport::kda_forward` / `tileport::kda_backward`
(so it works under torch.compile), whose bodies ask the dispatcher ("kda") for a backend:

    triton     the chunked WY / UT-transform algorithm, chunks of 64, forward and backward,
               sharing GDN's kernels through their PER_CHANNEL switch where the algebra is the
               same (kda/triton_kernels.py says which); also the CPU path under TRITON_INTERPRET=1
    gluon      (Hopper, bf16, K = V of 64 or 128) Triton's stages with the forward's states and
               output fused in one Gluon TMA + WGMMA kernel, which forms Vn from stage 3's T
               (kda/gluon_kernels.py); the backward is Triton's with its state recurrences and
               stages 9 and 10 on Gluon kernels
    reference  float64 PyTorch (reference.py): the step-by-step recurrence forward, and its
               closed-form reverse sweep backward

Status (twenty-first session, docs/perf/kda.md): the gluon forward at S1 0.970 ms on the H200
(rows 27, 28; FLA's 1.887 at f328a34's bench); its backward 6.74 ms at f328a34 (FLA 7.78).
Issue 6's goals (0.90 and 5.0 fwd+bwd) not met.

Status (sixteenth session):
- Triton and gluon pass the whole parity gate on the CPU (interpreter) and on the H200 (213 passed
  at 8dc64de; the kept-tiles path of row 19 with the parity and gluon files at c0b5da6, 64 passed).
- S1 on the H200 (bench at 366abfd, one run beside FLA): forward 1.581 ms (gluon) / 2.007 (triton)
  against FLA's 1.892; backward 8.61 (gluon) against 7.83; with the forward's tiles kept for the
  backward (row 19, kda_ab.py at c0b5da6) forward+backward 9.605 against FLA's 9.717 (another run).
  Issue 6's goals (0.90 and 5.0 fwd+bwd) not met.
- Head dims above 128 are refused by the Triton backend and fall back to the reference.
"""

from __future__ import annotations

import dataclasses

import torch

from tileport.devices import capability
from tileport.delta_rule_ops import make_delta_rule_op, state_dtype
from tileport.dispatch import Backend, OpDispatcher, gluon_available, kernel_dtype_and_capability_refusal, lazy_stages, reference_backend, register, triton_available
from tileport.memory import new_copy
from tileport.ops.gdn import validate_gdn_args
from tileport.ops.kda.reference import chunked_reference, kda_reference, recurrent_backward

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
_INDEX_DTYPES = (torch.int32, torch.int64)

@dataclasses.dataclass(frozen=True)
class KDACall:
    """What backends decide on. Built once per call; hashable, so decisions are cached on it."""

    K: int
    V: int
    dtype: torch.dtype
    device_type: str
    capability: tuple[int, int] | None


def _describe(q: torch.Tensor, v: torch.Tensor) -> KDACall:
    cap = capability(q.device)
    return KDACall(q.shape[-1], v.shape[-1], q.dtype, q.device.type, cap)


# --------------------------------------------------------------------------------------------
# Input validation: every bad input is a ValueError/TypeError naming the argument.
# --------------------------------------------------------------------------------------------
def validate_kda_args(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens) -> int:
    """GDN's checks, with g of shape [B, T, H, K]; returns the number of sequences."""
    return validate_gdn_args(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                             cu_seqlens, op_name="chunk_kda", per_channel_gate=True)


def _reference_forward(q, k, v, g, beta, scale, initial_state, output_final_state, use_l2, cu_seqlens):
    o, ht = kda_reference(q, k, v, g, beta, scale, initial_state, output_final_state, use_l2, cu_seqlens)
    return new_copy(o, q.dtype), (new_copy(ht, state_dtype(q.dtype)) if ht is not None else None)


def _reference_backward(do, dht, q, k, v, g, beta, scale, initial_state, use_l2, cu_seqlens):
    # The closed-form reverse sweep in float64 (autograd is switched off inside a custom op's body).
    # The parity tests check it, like every backend, against autograd through kda_reference.
    dq, dk, dv, dg, dbeta, dh0 = recurrent_backward(do, dht, q, k, v, g, beta, scale, initial_state, use_l2, cu_seqlens)
    return (new_copy(dq, q.dtype), new_copy(dk, k.dtype), new_copy(dv, v.dtype), new_copy(dg, g.dtype),
            new_copy(dbeta, beta.dtype), new_copy(dh0, initial_state.dtype) if dh0 is not None else None)


def _triton_refusal(call: KDACall) -> str | None:
    from tileport.ops.kda.triton_kernels import triton_refusal

    common = kernel_dtype_and_capability_refusal(call.dtype, call.device_type, call.capability)
    if common:
        return common
    return triton_refusal(call.K, call.V, call.dtype)


def _gluon_refusal(call: KDACall) -> str | None:
    from tileport.ops.kda.gluon_kernels import gluon_refusal

    if call.capability != (9, 0):
        return f"needs a Hopper GPU (sm_90), got {call.device_type} {call.capability}"
    # every stage but the output is Triton's: what Triton refuses, this backend refuses too
    return _triton_refusal(call) or gluon_refusal(call.K, call.V, call.dtype)


_triton_impl = lazy_stages("tileport.ops.kda.triton_kernels", "kda_forward_triton", "kda_backward_triton")

# Preference: gluon (Hopper, bf16, K = V of 64 or 128: Triton's stages with the forward's states
# and output on one Gluon kernel and the backward's recurrences and stages 9 and 10 on Gluon
# kernels; H200 bench at f328a34, S1: forward 1.227 ms against Triton's 2.006, backward 6.74
# against 9.26; the forward 0.970 since rows 27-28), then triton, then the float64 reference.
DISPATCHER = register(
    OpDispatcher(
        "kda",
        [
            Backend("gluon", gluon_available("tileport.ops.kda.gluon_kernels"), _gluon_refusal,
                    lazy_stages("tileport.ops.kda.gluon_kernels", "kda_forward_gluon", "kda_backward_gluon")),
            Backend("triton", triton_available("tileport.ops.kda.triton_kernels"), _triton_refusal, _triton_impl),
            reference_backend(_reference_forward, _reference_backward),
        ],
        signature=lambda call: call,
    )
)


def _backward_backend(backend: Backend) -> Backend:
    """The backend that computes the gradients of a forward run by `backend`: itself, or the
    reference when it has no backward yet (never a backward of a different algorithm's guess)."""
    if backend.impl.backward is not None:
        return backend
    return DISPATCHER._by_name["reference"]


def _forward_backend(q: torch.Tensor, v: torch.Tensor) -> Backend:
    return DISPATCHER.choose(_describe(q, v), q.device.type)


def _backward_chooser(q: torch.Tensor, v: torch.Tensor) -> Backend:
    return _backward_backend(_forward_backend(q, v))


# custom ops, fake impls, autograd (eager and compiled): tileport/delta_rule_ops.py, shared with GDN
# gluon and triton keep stage 3's G, T and flags for their backward (triton_kernels.KEEP_FORWARD_TILES),
# the gluon backend's fused forward also every chunk's h and Vn (KEEP_FORWARD_STATES)
_run = make_delta_rule_op("kda", _forward_backend, _backward_chooser, keeping_backends=("gluon", "triton"))


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention (FLA's `chunk_kda`).

    Args:
        q, k: `[B, T, H, K]`; v: `[B, T, H, V]` (bfloat16, float16 or float32, one dtype; float64
            runs on the reference backend).
        g: `[B, T, H, K]` natural-log decays per key channel (g <= 0), any float dtype (fp32 is usual).
        beta: `[B, T, H]`, any float dtype.
        scale: multiplies q; defaults to K ** -0.5.
        initial_state: `[N, H, K, V]` (N = B, or the number of sequences with cu_seqlens).
        output_final_state: also return the state after the last step.
        use_qk_l2norm_in_kernel: L2-normalise q and k over their last dim first
            (x * rsqrt(sum(x^2) + 1e-6)).
        cu_seqlens: `[N + 1]` int32/int64 offsets of N packed sequences (B must be 1); starts at 0,
            non-decreasing, ends at T.
    Returns:
        o `[B, T, H, V]` in q's dtype, and the final state `[N, H, K, V]` (fp32) or None.
        Gradients flow to q, k, v, g, beta and initial_state.
    """
    validate_kda_args(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def explain_call(shape: str, dtype: torch.dtype, device_type: str, capability: tuple[int, int] | None) -> KDACall:
    """The call `tileport explain kda --shape B,T,H,K,V` describes."""
    try:
        _B, _T, _H, K, V = (int(x) for x in shape.split(","))
    except ValueError:
        raise ValueError(f"--shape for kda is B,T,H,K,V (e.g. 8,4096,16,128,128), got {shape!r}") from None
    return KDACall(K, V, dtype, device_type, capability)


__all__ = ["chunk_kda", "kda_reference", "chunked_reference", "DISPATCHER", "KDACall", "explain_call"]
