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

Status: docs/perf/kda.md (each step's prediction and outcome on the H200) and issue 6's goals
(S1 forward 0.90 ms, forward+backward 5.0 ms): at 7f48ad3 the gluon forward 0.896 ms (graph
replay), forward+backward 7.12 (FLA 9.68); the forward+backward goal is not met. The parity gate:
tests/test_kda_*.py on the CPU (interpreter) and on the H200. Head dims above 128 are refused by
the Triton backend and fall back to the reference.
"""

from __future__ import annotations

import torch

from tileport.delta_rule_ops import DeltaRuleCall, delta_rule_op, explain_call_of
from tileport.ops.gdn import validate_gdn_args
from tileport.ops.kda.reference import chunked_reference, kda_reference, recurrent_backward


# --------------------------------------------------------------------------------------------
# Input validation: every bad input is a ValueError/TypeError naming the argument.
# --------------------------------------------------------------------------------------------
def validate_kda_args(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens) -> int:
    """GDN's checks, with g of shape [B, T, H, K]; returns the number of sequences."""
    return validate_gdn_args(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                             cu_seqlens, op_name="chunk_kda", per_channel_gate=True)


# --------------------------------------------------------------------------------------------
# Backends (tileport/delta_rule_ops.py, shared with GDN: the dispatcher, custom ops, fake impls,
# autograd in eager and compiled calls); gluon and triton keep stage 3's G, T and flags for their
# backward (triton_kernels.KEEP_FORWARD_TILES), the gluon backend's fused forward also every
# chunk's h and Vn (KEEP_FORWARD_STATES)
# --------------------------------------------------------------------------------------------
KDACall = DeltaRuleCall

# Preference: gluon (Hopper, bf16, K = V of 64 or 128: Triton's stages with the forward's states
# and output on one Gluon kernel and the backward's recurrences and stages 9 and 10 on Gluon
# kernels; H200 bench at 7f48ad3, S1: forward 0.896 ms in graph replay against Triton's 1.977,
# backward 6.06 against 9.23), then triton, then the float64 reference.
DISPATCHER, _triton_refusal, _run = delta_rule_op("kda", kda_reference, recurrent_backward,
                                                 keeping_backends=("gluon", "triton"))


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
    return explain_call_of("kda", shape, dtype, device_type, capability)


__all__ = ["chunk_kda", "kda_reference", "chunked_reference", "DISPATCHER", "KDACall", "explain_call"]
