"""Small KDA calls on the gluon backend for compute-sanitizer memcheck and racecheck (issue 6 asks
for racecheck clean): the forward's fused states + output kernel (`_kda_states_output_kernel`,
FORWARD_RECURRENCE "fused-t", the default: Vn formed from stage 3's T) on the first pass and its Gluon output kernel
(`_kda_output_wgmma_kernel`, whole chunks, after Triton's states kernel: "split") on the second,
with the forward's stage 3 on its Gluon kernel there (`_kda_solve_wgmma_kernel`, FORWARD_SOLVE "gluon"),
the backward's two state recurrences on GDN's `_tf32_recurrence_kernel` in its
PER_CHANNEL form (the recompute forced onto it: BACKWARD_STATES "gluon"), at TF32_RECURRENCE_BV
128 on 8 warps (the default) and 64 on 4, and the backward's stage 9 and 10 kernels
(`_kda_dqkwg_wgmma_kernel`; BACKWARD_DQKWG and BACKWARD_WY "gluon", the defaults) on the chunks
stage 3 leaves unflagged, stage 10 in its split form's two kernels (`_kda_wy_dA_kernel`,
`_kda_wy_pairs_kernel`, WY_FORM "split", the default) on the first pass and in one kernel
(`_kda_wy_bwd_wgmma_kernel`) on the second.

    python3 scripts/sanitize_kda.py [quick] [first] [q-registers] [u-formed] [dqkwg-loads] [states16] [dstates16] [w16]
        (first: the first pass only, the defaults; q-registers: gluon_kernels.Q_NORM "registers";
        u-formed: the split form's `_kda_wy_dA_kernel` reading a formed U, triton_kernels.BACKWARD_U_FROM_T
        off; by default it runs U_FREE, the one-kernel pass always with U formed; dqkwg-loads: stage
        9's kernel taking dO and its epilogue's tiles by pointer loads, gluon_kernels.DQKWG_TILES
        "loads" (by TMA, "tma", the default since the thirty-second session); states16: the forward's kept h and Vn in bf16, stage 9's kernel widening them,
        triton_kernels.KEPT_STATES_DTYPE "bf16", off by default; dstates16: stage 8's dh and dVn in
        bf16, stages 9 and 10 widening them, triton_kernels.BACKWARD_DSTATES_DTYPE "bf16", off by
        default; w16: the backward's W in bf16, stage 8 and the dA kernel widening it,
        triton_kernels.BACKWARD_W_DTYPE "bf16", off by default. Stage 7 runs on
        `_kda_dv_local_wgmma_kernel` and stage 8 on the bf16 keys' form of `_tf32_recurrence_kernel`,
        the defaults since the thirtieth session.)

Each case runs the forward and backward (T kept for the backward) and a forward under no_grad.

A dense batch with a ragged T (a partial last chunk) and a varlen batch with a length-1 and an
empty sequence, K = V = 64 and 128, gates whose chunks take both routes of the output (some
channels steep enough that stage 3 flags their chunks), forward and backward.
"""

import sys

import torch

import tileport
from tileport.dispatch import use_backend
from tileport.ops.gdn import gluon_kernels as gdn_gluon
from tileport.ops.kda import gluon_kernels as kda_gluon
from tileport.ops.kda import triton_kernels as kda_triton

torch.manual_seed(0)
quick = "quick" in sys.argv[1:]
cases = [dict(B=2, T=130, H=2, K=64, cu=None), dict(B=1, T=200, H=2, K=128, cu=[0, 1, 70, 70, 200])]
if not quick:
    cases.append(dict(B=1, T=1000, H=4, K=128, cu=None))
gdn_gluon.BACKWARD_STATES = "gluon"
if "q-registers" in sys.argv[1:]:
    kda_gluon.Q_NORM = "registers"
u_formed_split = "u-formed" in sys.argv[1:]
if "dqkwg-loads" in sys.argv[1:]:
    kda_gluon.DQKWG_TILES = "loads"
if "states16" in sys.argv[1:]:
    kda_triton.KEPT_STATES_DTYPE = "bf16"
if "dstates16" in sys.argv[1:]:
    kda_triton.BACKWARD_DSTATES_DTYPE = "bf16"
if "w16" in sys.argv[1:]:
    kda_triton.BACKWARD_W_DTYPE = "bf16"
# stage 10 in its split form (the default) and in one kernel (WY_FORM)
passes = ((128, 8, "split", "fused-t", "triton"), (64, 4, "one-kernel", "split", "gluon"))
for bv, warps, wy_form, recurrence, solve in passes[:1] if "first" in sys.argv[1:] else passes:
    gdn_gluon.TF32_RECURRENCE_BV, gdn_gluon.TF32_RECURRENCE_WARPS = bv, warps
    kda_gluon.WY_FORM = wy_form
    # U is formed for the one kernel, which reads it (without U its chunks would go to Triton's
    # kernel); the split form's dA kernel runs U_FREE by default (BACKWARD_U_FROM_T, kda.md row 36)
    kda_triton.BACKWARD_U_FROM_T = wy_form == "split" and not u_formed_split
    kda_gluon.FORWARD_RECURRENCE = recurrence
    kda_gluon.FORWARD_SOLVE = solve
    for c in cases:
        B, T, H, K = c["B"], c["T"], c["H"], c["K"]
        dev, bf = "cuda", torch.bfloat16
        q, k, v = (torch.randn(B, T, H, K, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=dev))
        g[:, : T // 3, 0, : K // 4] = -25.0  # steep channels on head 0: its early chunks flagged
        g.requires_grad_()
        beta = torch.rand(B, T, H, device=dev, dtype=bf, requires_grad=True)
        cu = torch.tensor(c["cu"], device=dev, dtype=torch.int32) if c["cu"] else None
        with use_backend("gluon", op="kda"):
            o, _ = tileport.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
            o.backward(torch.randn_like(o))
            with torch.no_grad():  # as inference runs it: no T kept (fused-t's T in bf16, FORWARD_T_DTYPE)
                tileport.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        torch.cuda.synchronize()
        print(f"forward {recurrence}, stage 3 {solve}, gluon recurrences BV{bv} {warps}w, stage 10 {wy_form} B={B} T={T} H={H} K={K} varlen={cu is not None}: ok")
