"""Gated DeltaNet: `chunk_gated_delta_rule`, as `fla.ops.gated_delta_rule.chunk_gated_delta_rule` computes it.

Per sequence and head, with state S (K x V, fp32) starting from `initial_state` or zeros:

    S = exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S = S + k_t u_t^T;   o_t = S^T (scale q_t)

Public entry point: `chunk_gated_delta_rule` (FLA's signature). The call is validated here, then runs
through the torch.library custom ops `tileport::gdn_forward` / `tileport::gdn_backward` (so it works
under torch.compile), whose bodies ask the dispatcher for a backend:

    triton     the chunked WY / UT-transform algorithm, chunks of 64 (triton_kernels.py); forward
               and backward; also the CPU path under TRITON_INTERPRET=1
    reference  float64 PyTorch (reference.py): the step-by-step recurrence forward, and its
               closed-form reverse sweep backward

The custom ops save only the inputs: the Triton backward recomputes the forward's intermediates.

Status and TODO (2026-11-30):
- Forward and backward pass the parity gate on the H200 (scripts/gpu-check tests at 6ec45b2:
  every GDN case, dense and varlen, the full-size S1 / B=1 T=32768 / varlen cases included) and
  under the CPU interpreter. triton 3.4-3.7.0 miscompiles FLA's gated dq/dk/dg backward on Hopper
  (FLA issue 640: `tl.trans` of a dot result fed to another dot); `chunk_dqkwg` / `chunk_wy_bwd`
  avoid that pattern (every transposed dot operand is a loaded tile or an elementwise function
  of one), and their H200 parity is the evidence that they are not hit.
- "gluon" (bf16, K = V of 64 or 128, sm_90; the first choice there since the ninth session) runs
  Triton's stages 1-3, then the Gluon recurrence + output kernel (where there are at least 64
  (sequence, head) pairs; Triton's forward otherwise); its backward is Triton's with the two state
  recurrences in Gluon. It passed tests/test_gdn_gluon.py on the H200 (5117b1b, a8d219f).
- Speed (docs/perf/gdn.md, bench at 43aa9df): the S1 forward is 0.591 ms (graph 0.581) on gluon and
  0.825 on Triton against FLA's 0.982 / 0.962; fwd+bwd 8.88 (gluon) against SDPA flash's 4.02.
- Head dims above 128 are refused by the Triton backend and fall back to the reference.
"""

from __future__ import annotations

import math

import torch

from tileport.delta_rule_ops import DeltaRuleCall, delta_rule_op, explain_call_of
from tileport.ops.gdn.reference import chunked_reference, gdn_reference, recurrent_backward

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # float64 runs on the reference only
MAX_HEAD_DIM = 256  # FLA's limit for K and V; the Triton kernels take up to 128
_INDEX_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------------------------
# Input validation: every bad input is a ValueError/TypeError naming the argument.
# --------------------------------------------------------------------------------------------
def _check_tensor(name: str, t, device: torch.device | None, dtypes=SUPPORTED_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; put every tensor on one device")


def _check_shape(name: str, t: torch.Tensor, expected: tuple, what: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {what} = {list(expected)}, got {list(t.shape)}")


def validate_gdn_args(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                      op_name: str = "chunk_gated_delta_rule", per_channel_gate: bool = False) -> int:
    """Raise on bad input; return N, the number of sequences (B, or len(cu_seqlens) - 1)."""
    _check_tensor("q", q, None)
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K] (rank 4), got rank {q.dim()} {list(q.shape)}")
    dev = q.device
    B, T, H, K = q.shape
    _check_tensor("k", k, dev)
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}; q, k and v must share one dtype")
    _check_shape("k", k, (B, T, H, K), "[B, T, H, K] like q")
    _check_tensor("v", v, dev)
    if v.dtype != q.dtype:
        raise TypeError(f"v has dtype {v.dtype} but q has {q.dtype}; q, k and v must share one dtype")
    if v.dim() != 4:
        raise ValueError(f"v must have shape [B, T, H, V] (rank 4), got rank {v.dim()} {list(v.shape)}")
    V = v.shape[-1]
    _check_shape("v", v, (B, T, H, V), "[B, T, H, V] with B, T, H of q")
    for name, d in (("K (q's last dim)", K), ("V (v's last dim)", V)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"unsupported head dim: {name} = {d}; {op_name} takes 1..{MAX_HEAD_DIM}")
    if H < 1:
        raise ValueError(f"q must have at least one head (H = q.shape[2]), got H = {H}")
    _check_tensor("g", g, dev)
    if per_channel_gate:  # KDA
        _check_shape("g", g, (B, T, H, K), "[B, T, H, K] (one decay per key channel)")
    else:
        _check_shape("g", g, (B, T, H), "[B, T, H]")
    _check_tensor("beta", beta, dev)
    _check_shape("beta", beta, (B, T, H), "[B, T, H]")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)):
        raise ValueError(f"scale must be None or a finite float, got {scale!r}")
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state must be a bool, got {type(output_final_state).__name__}")
    if not isinstance(use_qk_l2norm_in_kernel, bool):
        raise TypeError(f"use_qk_l2norm_in_kernel must be a bool, got {type(use_qk_l2norm_in_kernel).__name__}")

    N = B
    if cu_seqlens is not None:
        _check_tensor("cu_seqlens", cu_seqlens, dev, _INDEX_DTYPES)
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be a 1-D tensor [N + 1] with N >= 1, got shape {list(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1 (sequences packed along T), got B = {B}")
        cu = cu_seqlens.tolist()
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
        if any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
        if cu[-1] != T:
            raise ValueError(f"cu_seqlens must end at T = {T}, got {cu[-1]}")
        N = len(cu) - 1
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, dev)
        _check_shape("initial_state", initial_state, (N, H, K, V), "[N, H, K, V]" + (" (N = len(cu_seqlens) - 1)" if cu_seqlens is not None else " (N = B)"))
    return N


# --------------------------------------------------------------------------------------------
# Backends (tileport/delta_rule_ops.py, shared with KDA: the dispatcher, custom ops, fake impls,
# autograd in eager and compiled calls)
# --------------------------------------------------------------------------------------------
GDNCall = DeltaRuleCall

# Preference: gluon (Hopper, bf16, K and V of 64 or 128), then triton, then the float64
# reference. Gluon came first while its output kernel was the faster stage 6 (909a64e), Triton from
# f7de67f (its fused states + output beat gluon's split forward), and gluon again since its fused
# recurrence + output on two warpgroups (H200 at 470f621, scripts/gdn_ab.py, whole forward at
# S1: 0.690 ms against Triton's 0.818; with few (sequence, head) pairs gluon runs Triton's forward,
# FORWARD_FORM "auto"). The backward is Triton's, with its two state recurrences in Gluon in the
# gluon backend (gluon_kernels.BACKWARD_STATES, BACKWARD_DSTATES).
DISPATCHER, _triton_refusal, _run = delta_rule_op("gdn", gdn_reference, recurrent_backward)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def chunk_gated_delta_rule(
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
    """Gated DeltaNet (FLA's `chunk_gated_delta_rule`).

    Args:
        q, k: `[B, T, H, K]`; v: `[B, T, H, V]` (bfloat16, float16 or float32, one dtype; float64
            runs on the reference backend).
        g: `[B, T, H]` natural-log decays (g <= 0), any float dtype (fp32 is usual).
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
    validate_gdn_args(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def explain_call(shape: str, dtype: torch.dtype, device_type: str, capability: tuple[int, int] | None) -> GDNCall:
    """The call `tileport explain gdn --shape B,T,H,K,V` describes."""
    return explain_call_of("gdn", shape, dtype, device_type, capability)


__all__ = ["chunk_gated_delta_rule", "gdn_reference", "chunked_reference", "DISPATCHER", "GDNCall", "explain_call"]
