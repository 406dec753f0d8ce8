"""Instruction-issue floor of the GDN and KDA forward kernels at S1, from their sm_90a PTX on the CPU.

    python scripts/issue_floor.py

A kernel whose code is straight-line (these are: every loop is static_range, unrolled) issues
about (PTX instructions) x (warps) x (programs) warp-instructions; an H200 issues at most
4 per clock per SM (132 SMs, 1.98 GHz), so that count over 1.05e12 per second is a time no
schedule can beat. Between H200 runs it tells a latency-bound kernel (measured far above its
floor: GDN's solve_wu, 0.75 ms against ~0.19) from one that simply does too much (KDA's output
kernel: ~1.5 ms of issue alone), and what a rewrite adds or removes before it is timed.
PTX is not SASS (ptxas may fuse or expand), so read it as +-30%.
"""

import torch
import triton.language as tl
from tileport.compile_check import CompileCase, TensorStandIn as T, compile_case
from tileport.ops.gdn import triton_kernels as tk
from tileport.ops.kda import triton_kernels as kk
Ntok, H, NC, N, K, V = 32768, 16, 512, 8, 128, 128
bf, f32, f64, idx = torch.bfloat16, torch.float32, torch.float64, torch.int32  # plan tensors as on a GPU
tok = lambda d, t=bf: T([Ntok, H, d], t)
BK, BV, NV = tk._blocks(K, V)
common = dict(H=H, K=K, BK=BK, BT=64, DT=tl.bfloat16, DA=tl.bfloat16)
ISSUE = 4 * 132 * 1.98e9  # warp-instructions per second, H200 (4 schedulers per SM)
def instr(ptx: str) -> int:
    """PTX instructions (predicated ones included): not directives, labels, braces or comments."""
    n = 0
    for line in ptx.splitlines():
        s = line.strip()
        if not s or s.startswith(("//", ".", "{", "}")) or s.endswith(":"):
            continue
        n += 1
    return n


def report(name, fn, args, warps, programs, stages=1, loop=1):
    r = compile_case(CompileCase(name, fn, args, num_warps=warps, options={"num_stages": stages}))
    n = instr(r.ptx)
    t = n * warps * programs * loop / ISSUE * 1e3
    print(f"{name:38s} regs={r.n_regs} spills={r.n_spills} ptx_instr={n:6d} warps={warps} programs={programs:6d} x{loop}: issue floor ~{t:.3f} ms", flush=True)
for pc, G in ((False, T([Ntok, H], f64)), (True, tok(K, f64))):
    tag = "kda" if pc else "gdn"
    for factored in ((False, True) if pc else (False,)):  # factored: both branches in the PTX (an upper bound)
        report(f"{tag} solve_wu blocks{' factored diag' if factored else ''} 8w", tk._solve_wu_kernel.fn, dict(
            k_ptr=tok(K), v_ptr=tok(V), beta_ptr=T([Ntok, H], bf), G_ptr=G, Ai_ptr=tok(K), w_ptr=tok(K), u_ptr=tok(V),
            chunks_ptr=T([2 * NC], idx), V=V, BV=BV, NV=NV, PER_CHANNEL=pc, STORE_T=False, EXACT_WU=False,
            FACTORED_DIAGONAL=factored, **common), 8, NC * H)
    report(f"{tag} states BV32 4w", tk._states_kernel.fn, dict(k_ptr=tok(K), w_ptr=tok(K), u_ptr=tok(V), G_ptr=G, h0_ptr=T([N, H, K, V], f32),
        h_ptr=T([NC, H, K, V], bf), vn_ptr=tok(V), ht_ptr=T([N, H, K, V], f32), cu_ptr=T([N + 1], idx), choff_ptr=T([N], idx), NH_BUCKET=128, V=V, BV=32,
        q_ptr=tok(K), o_ptr=tok(V), scale=0.1, eps=1e-6, HAS_H0=False, STORE_FINAL=False, PER_CHANNEL=pc, FUSE_OUTPUT=False,
        L2NORM_Q=False, **common), 4, N * H * (V // 32), loop=NC // N)
    if not pc:
        report("gdn states+output fused BV32 4w", tk._states_kernel.fn, dict(k_ptr=tok(K), w_ptr=tok(K), u_ptr=tok(V), G_ptr=G,
            h0_ptr=T([N, H, K, V], f32), h_ptr=T([NC, H, K, V], bf), vn_ptr=tok(V), ht_ptr=T([N, H, K, V], f32),
            cu_ptr=T([N + 1], idx), choff_ptr=T([N], idx), NH_BUCKET=128, V=V, BV=32, q_ptr=tok(K), o_ptr=tok(V), scale=0.1,
            eps=1e-6, HAS_H0=False, STORE_FINAL=False, PER_CHANNEL=False, FUSE_OUTPUT=True, L2NORM_Q=True, **common),
            4, N * H * (V // 32), loop=NC // N)
report("gdn solve_wu tile 8w", tk._solve_wu_tile_kernel.fn, dict(k_ptr=tok(K), v_ptr=tok(V), beta_ptr=T([Ntok, H], bf), G_ptr=T([Ntok, H], f64), Ai_ptr=tok(K),
        w_ptr=tok(K), u_ptr=tok(V), chunks_ptr=T([2 * NC], idx), V=V, BV=BV, NV=NV, PREC="tf32x3", STORE_T=False, EXACT_WU=False, **common), 8, NC * H)
report("gdn output BV128 8w", tk._output_kernel.fn, dict(q_ptr=tok(K), k_ptr=tok(K), G_ptr=T([Ntok, H], f64), h_ptr=T([NC, H, K, V], bf), vn_ptr=tok(V), o_ptr=tok(V),
        chunks_ptr=T([2 * NC], idx), NC=NC, scale=0.1, eps=1e-6, V=V, BV=128, L2NORM_Q=True, PER_SM=0, **common), 8, NC * H)
for factored in (False, True):  # factored: both branches are in the PTX, so its count is an upper bound
    report(f"kda output{' factored diag' if factored else ''} 4w", kk._kda_output_kernel, dict(q_ptr=tok(K), k_ptr=tok(K),
        G_ptr=tok(K, f64), h_ptr=T([NC, H, K, V], bf), vn_ptr=tok(V), o_ptr=tok(V), chunks_ptr=T([2 * NC], idx), scale=0.1,
        V=V, BV=BV, NV=NV, FACTORED_DIAGONAL=factored, **common), 4, NC * H * NV)

# backward (the recompute's intermediates in fp32), GDN only
L = tk._LAUNCH
BKS, NK = tk._key_split(K)
PREC = tk._products(torch.bfloat16, for_backward=True)[2]  # the backward's products (BACKWARD_PRODUCTS)
report("gdn dqkwg 8w", tk._dqkwg_kernel, dict(
    q_ptr=tok(K), k_ptr=tok(K), G_ptr=T([Ntok, H], f64), h_ptr=T([NC, H, K, V], f32), dh_ptr=T([NC, H, K, V], f32),
    vn_ptr=tok(V, f32), dvn_ptr=tok(V, f32), do_ptr=tok(V), dql_ptr=tok(K, f32), dkl_ptr=tok(K, f32), dq_ptr=tok(K),
    dk_ptr=tok(K, f32), dw_ptr=tok(K, f32), dG_ptr=T([NK, Ntok, H], f32), chunks_ptr=T([2 * NC], idx), scale=0.1,
    dG_stride=Ntok * H, V=V, BV=BV, NV=NV, BKS=BKS, DS_HERE=True, PREC=PREC, **{k: v for k, v in common.items() if k != "BK"}),
    L["dqkwg"]["num_warps"], NC * NK * H)
report("gdn wy_bwd 8w", tk._wy_bwd_kernel, dict(
    k_ptr=tok(K), v_ptr=tok(V), beta_ptr=T([Ntok, H], bf), G_ptr=T([Ntok, H], f64), Ai_ptr=tok(64, f32),
    w_ptr=tok(K, f32), u_ptr=tok(V, f32), dw_ptr=tok(K, f32), dvn_ptr=tok(V, f32), dkp_ptr=tok(K, f32),
    dGp_ptr=T([NK, Ntok, H], f32), dk_ptr=tok(K), dv_ptr=tok(V), dbeta_ptr=T([Ntok, H], bf), dg_ptr=T([Ntok, H], f32),
    da_ptr=tok(64, f32), dat_ptr=tok(64, f32), vdu_ptr=T([Ntok, H], f32), chunks_ptr=T([2 * NC], idx),
    dGp_stride=Ntok * H, V=V, BV=BV, NV=NV, NKP=NK, BKW=min(common["BK"], tk.WY_BWD_KEY_BLOCK), PHASE="all",
    PREC=PREC, **common), L["wy_bwd"]["num_warps"], NC * H)
report("gdn solve_wu blocks recompute 8w", tk._solve_wu_kernel.fn, dict(k_ptr=tok(K), v_ptr=tok(V), beta_ptr=T([Ntok, H], bf),
    G_ptr=T([Ntok, H], f64), Ai_ptr=tok(64, f32), w_ptr=tok(K, f32), u_ptr=tok(V, f32), chunks_ptr=T([2 * NC], idx), V=V, BV=BV,
    NV=NV, PER_CHANNEL=False, STORE_T=True, EXACT_WU=True, **common), 8, NC * H)
report("gdn solve_wu tile recompute 8w", tk._solve_wu_tile_kernel.fn, dict(k_ptr=tok(K), v_ptr=tok(V), beta_ptr=T([Ntok, H], bf),
    G_ptr=T([Ntok, H], f64), Ai_ptr=tok(64, f32), w_ptr=tok(K, f32), u_ptr=tok(V, f32), chunks_ptr=T([2 * NC], idx), V=V, BV=BV,
    NV=NV, PREC="tf32x3", STORE_T=True, EXACT_WU=True, **common), 8, NC * H)
