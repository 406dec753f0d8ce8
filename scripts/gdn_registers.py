"""Registers, spills and shared memory of every GDN Triton kernel, compiled for sm_90a on the CPU.

    python scripts/gdn_registers.py [bf16|fp32] [K] [V] [--sass]

--sass adds each kernel's SASS instruction mix (static counts, `compile_check.sass_census`): the
total, FFMA (fp32 products on FMA units), HGMMA / HMMA (tensor cores) and LDL / STL (spill traffic).

No GPU needed (tileport.compile_check): the proxy for register pressure used between H200 runs,
since spills were a large part of the backward's time (docs/perf/gdn.md). Autotuned kernels are
compiled once per candidate.
"""

import sys

import torch
import triton.language as tl

from tileport.compile_check import CompileCase, TensorStandIn as T, compile_case, sass_census
from tileport.ops.gdn import triton_kernels as tk

SASS = "--sass" in sys.argv
argv = [a for a in sys.argv[1:] if a != "--sass"]
dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[argv[0] if argv else "bf16"]
K = int(argv[1]) if len(argv) > 1 else 128
V = int(argv[2]) if len(argv) > 2 else 128
Ntok, H, NC, N = 32768, 16, 512, 8
DT = tl.float32 if dt == torch.float32 else tl.bfloat16
BK, BV, NV = tk._blocks(K, V)
f32, f64, idx = torch.float32, torch.float64, torch.int32  # the plan on a GPU (plan_index_dtype)
inter = f32  # the backward's recompute; the forward stores bf16 for 16-bit inputs
fwd_inter = tk._intermediate_dtype(dt, compact=True)
tok = lambda d, t=None: T([Ntok, H, d], t or dt)  # noqa: E731
common = dict(H=H, K=K, BK=BK, BT=64, DT=DT, DA=DT)
# the backward's kernels (and its recompute of stage 5) multiply at `_products(dt, True)`'s PREC
bwd = dict(common, PREC=tk._products(dt, for_backward=True)[2])


def tile_precisions(recompute: bool) -> dict:
    """The tile solve's products and diagonal inverses as the op runs them with l2-normalised keys
    (the bench's inputs): the forward's NORMALISED_KEYS_*, the recompute's RECOMPUTE_NORMALISED_KEYS_*."""
    if dt == torch.float32:
        return dict(PREC="ieee", DIAG_PREC="ieee")
    if recompute:
        return dict(PREC=tk.RECOMPUTE_NORMALISED_KEYS_PREC, DIAG_PREC=tk.RECOMPUTE_NORMALISED_KEYS_DIAG_PREC)
    return dict(PREC=tk.NORMALISED_KEYS_PREC, DIAG_PREC=tk.NORMALISED_KEYS_DIAG_PREC)


def cases():
    for o in tk.SOLVE_WU_OPTIONS:
        for store_T, w_t in ((False, fwd_inter), (True, inter)):
            yield f"solve_wu store_T={store_T} {o}", tk._solve_wu_kernel.fn, o, dict(
                k_ptr=tok(K), v_ptr=tok(V), beta_ptr=T([Ntok, H], dt), G_ptr=T([Ntok, H], f64), Ai_ptr=tok(64, f32),
                w_ptr=tok(K, w_t), u_ptr=tok(V, w_t), chunks_ptr=T([2 * NC], idx), V=V, BV=BV, NV=NV,
                PER_CHANNEL=False, STORE_T=store_T, EXACT_WU=store_T, **common)
    for o in tk.SOLVE_WU_TILE_OPTIONS:
        for store_T, w_t in ((False, fwd_inter), (True, inter)):
            yield f"solve_wu_tile store_T={store_T} {o}", tk._solve_wu_tile_kernel.fn, o, dict(
                k_ptr=tok(K), v_ptr=tok(V), beta_ptr=T([Ntok, H], dt), G_ptr=T([Ntok, H], f64), Ai_ptr=tok(64, f32),
                w_ptr=tok(K, w_t), u_ptr=tok(V, w_t), chunks_ptr=T([2 * NC], idx), V=V, BV=BV, NV=NV,
                STORE_T=store_T, EXACT_WU=store_T, **tile_precisions(store_T), **common)
    for o in tk.STATES_OPTIONS:
        for w_t, fuse, l2k in ((fwd_inter, False, False), (inter, False, False), (fwd_inter, True, False),
                               (fwd_inter, True, True)):
            tag = (" fused with output" if fuse else "") + (", keys normalised on load" if l2k else "")
            yield f"states inter={w_t}{tag} {o}", tk._states_kernel.fn, o, dict(
                k_ptr=tok(K), w_ptr=tok(K, w_t), u_ptr=tok(V, w_t), G_ptr=T([Ntok, H], f64), h0_ptr=T([N, H, K, V], f32),
                h_ptr=T([NC, H, K, V], w_t), vn_ptr=tok(V, w_t), ht_ptr=T([N, H, K, V], f32), cu_ptr=T([N + 1], idx),
                choff_ptr=T([N], idx), NH_BUCKET=128, q_ptr=tok(K), o_ptr=tok(V), scale=0.1, eps=1e-6, V=V, BV=o["BV"],
                HAS_H0=True, STORE_FINAL=True, PER_CHANNEL=False, FUSE_OUTPUT=fuse, L2NORM_Q=fuse, L2NORM_K=l2k,
                **(bwd if w_t == inter else common))
    for o in tk.OUTPUT_OPTIONS:
        yield f"output {o}", tk._output_kernel.fn, o, dict(
            q_ptr=tok(K), k_ptr=tok(K), G_ptr=T([Ntok, H], f64), h_ptr=T([NC, H, K, V], fwd_inter), vn_ptr=tok(V, fwd_inter),
            o_ptr=tok(V), chunks_ptr=T([2 * NC], idx), NC=NC, scale=0.1, eps=1e-6, V=V, BV=o["BV"], L2NORM_Q=True,
            PER_SM=o["PER_SM"], **common)
    L = tk._LAUNCH
    yield "dv_local", tk._dv_local_kernel, L["dv_local"], dict(
        q_ptr=tok(K), k_ptr=tok(K), G_ptr=T([Ntok, H], f64), do_ptr=tok(V), dvl_ptr=tok(V, f32), chunks_ptr=T([2 * NC], idx),
        scale=0.1, V=V, BV=BV, NV=NV, **bwd)
    for o in tk.DSTATES_OPTIONS:
        yield f"dstates {o}", tk._dstates_kernel.fn, o, dict(
        q_ptr=tok(K), k_ptr=tok(K), w_ptr=tok(K, f32), G_ptr=T([Ntok, H], f64), do_ptr=tok(V), dvl_ptr=tok(V, f32),
            dht_ptr=T([N, H, K, V], f32), dh_ptr=T([NC, H, K, V], f32), dvn_ptr=tok(V, f32), dh0_ptr=T([N, H, K, V], f32),
            cu_ptr=T([N + 1], idx), choff_ptr=T([N], idx), NH_BUCKET=128, scale=0.1, V=V, BV=o["BV"], HAS_DHT=True, STORE_DH0=True,
            **bwd)
    for ds_here in (True, False):  # DQKWG_FORM "one", and "split"'s state part
        yield f"dqkwg{'' if ds_here else ' (split: state part)'}", tk._dqkwg_kernel, L["dqkwg"], dict(
            q_ptr=tok(K), k_ptr=tok(K), G_ptr=T([Ntok, H], f64), h_ptr=T([NC, H, K, V], f32), dh_ptr=T([NC, H, K, V], f32),
            vn_ptr=tok(V, f32), dvn_ptr=tok(V, f32), do_ptr=tok(V), dql_ptr=tok(K, f32), dkl_ptr=tok(K, f32), dq_ptr=tok(K),
            dk_ptr=tok(K, f32), dw_ptr=tok(K, f32), dG_ptr=T([2, Ntok, H], f32), chunks_ptr=T([2 * NC], idx), scale=0.1,
            dG_stride=Ntok * H, V=V, BV=BV, NV=NV, BKS=tk._key_split(K)[0], DS_HERE=ds_here,
            **{k: v for k, v in bwd.items() if k != "BK"})
    yield "dqk_local (split: chunk-local part)", tk._dqk_local_kernel, L["dqkwg"], dict(
        q_ptr=tok(K), k_ptr=tok(K), G_ptr=T([Ntok, H], f64), vn_ptr=tok(V, f32), do_ptr=tok(V), dql_ptr=tok(K, f32),
        dkl_ptr=tok(K, f32), dG_ptr=T([Ntok, H], f32), chunks_ptr=T([2 * NC], idx), scale=0.1, V=V, BV=BV, NV=NV,
        BKS=tk._key_split(K)[0], **{k: v for k, v in bwd.items() if k != "BK"})
    for phase in ("all", "da", "apply"):  # WY_BWD_FORM "one", and "split"'s two halves
        yield f"wy_bwd{'' if phase == 'all' else f' (split: {phase})'}", tk._wy_bwd_kernel, L["wy_bwd"], dict(
            k_ptr=tok(K), v_ptr=tok(V), beta_ptr=T([Ntok, H], dt), G_ptr=T([Ntok, H], f64), Ai_ptr=tok(64, f32),
            w_ptr=tok(K, f32), u_ptr=tok(V, f32), dw_ptr=tok(K, f32), dvn_ptr=tok(V, f32), dkp_ptr=tok(K, f32),
            dGp_ptr=T([2, Ntok, H], f32), dk_ptr=tok(K), dv_ptr=tok(V), dbeta_ptr=T([Ntok, H], dt), dg_ptr=T([Ntok, H], f32),
            da_ptr=tok(64, f32), dat_ptr=tok(64, f32), vdu_ptr=T([Ntok, H], f32), chunks_ptr=T([2 * NC], idx),
            dGp_stride=Ntok * H, V=V, BV=BV, NV=NV, NKP=tk._key_split(K)[1], BKW=min(bwd["BK"], tk.WY_BWD_KEY_BLOCK),
            PHASE=phase, **bwd)


for name, fn, launch, args in cases():
    opts = {k: launch[k] for k in ("num_stages", "maxnreg") if k in launch}
    try:
        r = compile_case(CompileCase(name, fn, args, num_warps=launch.get("num_warps", 4), options=opts))
        mix = ""
        if SASS:
            c = sass_census(r)
            mix = " sass: " + " ".join(f"{op}={c.get(op, 0)}" for op in ("total", "FFMA", "HGMMA", "HMMA", "LDL", "STL"))
        print(f"{r.summary()}{mix}")
    except Exception as exc:  # report and go on: one kernel's failure says nothing about the others
        print(f"{name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
