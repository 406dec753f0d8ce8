"""GDN's and KDA's Triton kernels on the forward's hot path compile for sm_90a on a CPU-only machine, in the launch forms
the forward uses, within a spill budget; GDN's backward kernels compile in their BACKWARD_PRODUCTS form.

The interpreter runs the parity gate but never compiles: a kernel it accepts can still fail to
lower on the GPU (the Gluon output kernel's int64 TMA coordinates did, 2026-11-29), and 3D dots
and 4D reshapes such as the tile form's are exactly what the interpreter passes through numpy.
scripts/gdn_registers.py prints every kernel and candidate; this test keeps the two forms of the
kernel on the forward's hot path honest in CI. Run with -s to see registers/spills/SMEM.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tileport.dispatch import interpreter_enabled  # noqa: E402

if interpreter_enabled():  # scripts/test runs this file in its second, compiled pass
    pytest.skip("compiling for sm_90a needs the JIT, which TRITON_INTERPRET=1 replaces", allow_module_level=True)

from tileport.compile_check import CompileCase, TensorStandIn as T, compile_case  # noqa: E402
from tileport.ops.gdn import triton_kernels as tk  # noqa: E402

Ntok, H, NC, K, V = 32768, 16, 512, 128, 128
bf, f32, f64, idx = torch.bfloat16, torch.float32, torch.float64, torch.int32  # plan tensors as on a GPU


def _args(backward: bool) -> dict:
    inter = f32 if backward else bf  # the backward's recompute stores fp32 W/U and T
    BK, BV, NV = tk._blocks(K, V)
    return dict(k_ptr=T([Ntok, H, K], bf), v_ptr=T([Ntok, H, V], bf), beta_ptr=T([Ntok, H], bf),
                G_ptr=T([Ntok, H], f64), Ai_ptr=T([Ntok, H, 64], f32), w_ptr=T([Ntok, H, K], inter),
                u_ptr=T([Ntok, H, V], inter), chunks_ptr=T([2 * NC], idx), H=H, K=K, V=V, BK=BK, BV=BV, NV=NV,
                BT=64, DT=tl.bfloat16, DA=tl.bfloat16, STORE_T=backward, EXACT_WU=backward)


# (name, kernel, extra args, warps, spill bound in bytes per thread for the forward form)
FORMS = [
    ("blocks", tk._solve_wu_kernel.fn, dict(PER_CHANNEL=False), 8, 0),
    ("tile", tk._solve_wu_tile_kernel.fn, dict(PREC="tf32x3"), 8, 0),
    # keys normalised on load (L2NORM_K_FORM, off: slower on the H200 at 667cd8c). 8 warps: at 4 (the
    # autotuner's pick on the H200) every tile variant spills, 204-444 B (sm_90a, 2026-11-29)
    ("tile-tf32-l2k", tk._solve_wu_tile_kernel.fn, dict(PREC="tf32", eps=1e-6, L2NORM_K=True), 8, 0),
    # the forward's precisions for normalised keys (NORMALISED_KEYS_PREC): one-pass tf32 (the
    # default df3acc3-b9a387e) and the [64, 64] products in one bf16 pass (the default since b9a387e;
    # half the shared memory: 24 KB)
    ("tile-tf32", tk._solve_wu_tile_kernel.fn, dict(PREC="tf32"), 8, 0),
    ("tile-bf16", tk._solve_wu_tile_kernel.fn, dict(PREC="bf16"), 8, 0),
    # the forward's default since the seventh session: bf16 products, the raw keys normalised on load
    # and stored for the states kernel (L2NORM_K_FORM "stage-3"), at 4 warps, the H200's pick
    ("tile-bf16-l2k-store", tk._solve_wu_tile_kernel.fn,
     dict(PREC="bf16", eps=1e-6, L2NORM_K=True, kn_ptr=T([Ntok, H, K], bf), STORE_KN=True), 4, 256),
    # and with the gates' in-chunk sums formed there too (CUMSUM_FORM "stage-3", the default since
    # the eighth session), with the diagonal inverses in fp32 ...
    ("tile-bf16-l2k-store-cumsum", tk._solve_wu_tile_kernel.fn,
     dict(PREC="bf16", eps=1e-6, L2NORM_K=True, kn_ptr=T([Ntok, H, K], bf), STORE_KN=True,
          g_ptr=T([Ntok, H], f32), CUMSUM_G=True), 4, 256),
    # ... and on tensor cores (NORMALISED_KEYS_DIAG_PREC "tf32", the default since then: the
    # forward's stage 3 as it runs; 184 registers and no spills on 2026-11-30)
    ("tile-bf16-l2k-store-cumsum-diag-tf32", tk._solve_wu_tile_kernel.fn,
     dict(PREC="bf16", eps=1e-6, L2NORM_K=True, kn_ptr=T([Ntok, H, K], bf), STORE_KN=True,
          g_ptr=T([Ntok, H], f32), CUMSUM_G=True, DIAG_PREC="tf32"), 4, 0),
    ("tile-bf16-l2k-store-factored", tk._solve_wu_tile_kernel.fn,
     dict(PREC="bf16", eps=1e-6, L2NORM_K=True, kn_ptr=T([Ntok, H, K], bf), STORE_KN=True, T_CHAIN="factored"), 4, 256),
]


def test_gdn_split_solve_compiles_for_sm90a():
    """WU_FORM "split": the tile kernel storing T alone in bf16 and the column-block W/U kernel."""
    t_only = dict(_args(False), PREC="tf32", STORE_T=True, WITH_WU=False, Ai_ptr=T([Ntok, H, 64], bf),
                  DIAG_PREC=tk.NORMALISED_KEYS_DIAG_PREC)  # the split forward passes the forward's diagonal precision
    wu = dict(t_ptr=T([Ntok, H, 64], bf), x_ptr=T([Ntok, H, K], bf), beta_ptr=T([Ntok, H], bf), G_ptr=T([Ntok, H], f64),
              out_ptr=T([Ntok, H, K], bf), chunks_ptr=T([2 * NC], idx), H=H, D=K, BC=64, NCB=K // 64, BT=64,
              DT=tl.bfloat16, DA=tl.bfloat16, GATED=True)
    for name, fn, args, warps in (("T only", tk._solve_wu_tile_kernel.fn, t_only, 8),
                                  ("W/U from T", tk._wu_from_t_kernel, wu, tk.WU_FROM_T_LAUNCH["num_warps"])):
        report = compile_case(CompileCase(f"gdn solve split: {name}", fn, args, num_warps=warps, options={"num_stages": 1}))
        print(f"\n{report.summary()}")
        assert report.target_line is not None and "sm_90a" in report.target_line, report.target_line
        assert "mma" in report.ptx, "no tensor-core instruction in the PTX"
        assert report.n_spills is None or report.n_spills == 0, f"{report.n_spills} bytes of spills"


def test_kda_wu_from_kept_t_compiles_for_sm90a():
    """KDA's backward from its forward's T (KEEP_FORWARD_TILES, `chunk_wu_from_t_kda`): the column-block
    W/U kernel with PER_CHANNEL gates (G [Ntok, H, K] fp32) and fp32 operands: the whole chunks at
    the recompute's one-pass tf32 and three-pass tf32x3, the flagged ones at tf32x3, each route on
    stage 3's flags, at its launch: tensor-core products, no spills."""
    from tileport.ops.kda import triton_kernels as kk

    for prec, chunks in (("tf32", "whole"), ("tf32x3", "whole"), ("tf32x3", "flagged")):
        args = dict(t_ptr=T([Ntok, H, 64], f32), x_ptr=T([Ntok, H, K], f32), beta_ptr=T([Ntok, H], bf),
                    G_ptr=T([Ntok, H, K], f32), out_ptr=T([Ntok, H, K], f32), chunks_ptr=T([2 * NC], idx), H=H, D=K,
                    BC=64, NCB=K // 64, BT=64, DT=tl.float32, DA=tl.float32, GATED=True, PER_CHANNEL=True, PREC=prec,
                    CHUNKS=chunks, flags_ptr=T([NC, H], torch.int8))
        report = compile_case(CompileCase(f"kda W/U from kept T ({prec}, {chunks})", tk._wu_from_t_kernel, args,
                                          num_warps=kk.WU_FROM_T_KDA_LAUNCH["num_warps"],
                                          options={"num_stages": kk.WU_FROM_T_KDA_LAUNCH["num_stages"]}))
        print(f"\n{report.summary()}")
        assert report.target_line is not None and "sm_90a" in report.target_line, report.target_line
        assert "mma" in report.ptx, "no tensor-core instruction in the PTX"
        assert report.n_spills is None or report.n_spills == 0, f"{report.n_spills} bytes of spills"


# bf16 and the stage-3 normalisation are the forward's only; the recompute is compiled at tf32x3
# (its default) and at one-pass tf32 ("tile-tf32": RECOMPUTE_NORMALISED_KEYS_PREC's option) and in
# the factored T chain (T_CHAIN takes every tile-form call)
FORWARD_ONLY = ("tile-bf16", "tile-bf16-l2k-store", "tile-bf16-l2k-store-cumsum", "tile-bf16-l2k-store-factored",
                "tile-bf16-l2k-store-cumsum-diag-tf32")
FORMS.append(("tile-factored", tk._solve_wu_tile_kernel.fn, dict(PREC="tf32x3", T_CHAIN="factored"), 8, 0))
# one-pass tf32 products with the diagonal inverses on tensor cores: the recompute in
# RECOMPUTE_NORMALISED_KEYS_DIAG_PREC "tf32" (log row 28: 84 B of spills at 4 warps, 848 in fp32)
FORMS.append(("tile-tf32-diag-tf32", tk._solve_wu_tile_kernel.fn, dict(PREC="tf32", DIAG_PREC="tf32"), 4, 128))
SOLVE_CASES = [(f, backward) for f in FORMS for backward in (False, True) if not (backward and f[0] in FORWARD_ONLY)]


@pytest.mark.parametrize("form,backward", SOLVE_CASES,
                         ids=[f"{f[0]}-{'recompute' if b else 'forward'}" for f, b in SOLVE_CASES])
def test_gdn_solve_wu_compiles_for_sm90a(form, backward):
    name, fn, extra, warps, max_spills = form
    report = compile_case(CompileCase(f"gdn solve_wu {name} {'recompute' if backward else 'forward'}", fn,
                                      dict(_args(backward), **extra), num_warps=warps, options={"num_stages": 1}))
    print(f"\n{report.summary()}")
    assert report.target_line is not None and "sm_90a" in report.target_line, report.target_line
    assert "mma" in report.ptx, "no tensor-core instruction in the PTX"
    if not backward and report.n_spills is not None:
        assert report.n_spills <= max_spills, f"{report.n_spills} bytes of spills ({report.n_regs} registers)"


def _forward_as_run() -> dict:
    """The forward's stage 3 as the op runs it by default: raw keys normalised and stored there,
    G formed there, NORMALISED_KEYS_PREC products and NORMALISED_KEYS_DIAG_PREC inverses."""
    return dict(_args(False), PREC=tk.NORMALISED_KEYS_PREC, eps=1e-6, L2NORM_K=True, kn_ptr=T([Ntok, H, K], bf),
                STORE_KN=True, g_ptr=T([Ntok, H], f32), CUMSUM_G=True, DIAG_PREC=tk.NORMALISED_KEYS_DIAG_PREC)


def test_gdn_capped_solve_candidates_fit_their_cap():
    """The register-capped candidates of the tile solve (SOLVE_WU_TILE_OPTIONS with maxnreg), in
    the forward's form as it runs: they exist for occupancy, which only holds if ptxas keeps the
    kernel within the cap, and they were timed (log row 26) at 64 B of spills, not more."""
    capped = [o for o in tk.SOLVE_WU_TILE_OPTIONS if o.get("maxnreg")]
    assert capped, "no capped candidate"
    # the autotuner launches them with the cap (tileport.autotuning.configs hands it to triton.Config)
    assert [c.maxnreg for c in tk._configs(capped)] == [o["maxnreg"] for o in capped]
    args = _forward_as_run()
    for o in capped:
        report = compile_case(CompileCase(f"gdn solve_wu tile capped {o}", tk._solve_wu_tile_kernel.fn, args,
                                          num_warps=o["num_warps"],
                                          options={"num_stages": o["num_stages"], "maxnreg": o["maxnreg"]}))
        print(f"\n{report.summary()}")
        assert report.n_regs is not None and report.n_regs <= o["maxnreg"], report.summary()
        assert report.n_spills is not None and report.n_spills <= 96, report.summary()


def test_gdn_forward_solve_inverts_its_diagonal_on_tensor_cores():
    """The forward's stage 3 as the op runs it (NORMALISED_KEYS_DIAG_PREC): with "tf32" its six
    dependent 16x16 products are tensor-core instructions (HMMA), not the 768 FFMA per thread they
    were in fp32 (the instruction mix that found log row 26, `compile_check.sass_census`)."""
    from tileport.compile_check import sass_census

    report = compile_case(CompileCase("gdn solve_wu tile, forward as run", tk._solve_wu_tile_kernel.fn, _forward_as_run(),
                                      num_warps=4, options={"num_stages": 1}))
    mix = sass_census(report)
    print(f"\n{report.summary()} sass total={mix['total']} FFMA={mix.get('FFMA', 0)} HMMA={mix.get('HMMA', 0)}")
    if tk.NORMALISED_KEYS_DIAG_PREC == "tf32":
        assert mix.get("HMMA", 0) > 0 and mix.get("FFMA", 0) < 256, mix
    else:
        assert mix.get("FFMA", 0) >= 768, mix  # the fp32 inverses: 6 products x 128 FMA per thread


# KDA's per-channel kernels in both diagonal forms (DIAGONAL_FORM): the factored path's run-time
# branch must lower for sm_90a (the interpreter does not check that a name is bound the same way
# in both branches; the JIT does, and a loop variable shadowing the V-block index once failed it)
def _kda_output_args(factored: bool) -> dict:
    BK, BV, NV = tk._blocks(K, V)
    return dict(q_ptr=T([Ntok, H, K], bf), k_ptr=T([Ntok, H, K], bf), G_ptr=T([Ntok, H, K], f64),
                h_ptr=T([NC, H, K, V], bf), vn_ptr=T([Ntok, H, V], bf), o_ptr=T([Ntok, H, V], bf),
                chunks_ptr=T([2 * NC], idx), H=H, scale=0.1, K=K, V=V, BK=BK, BV=BV, NV=NV, BT=64,
                DT=tl.bfloat16, DA=tl.bfloat16, FACTORED_DIAGONAL=factored)


@pytest.mark.parametrize("factored", [False, True], ids=["exact", "factored"])
def test_kda_kernels_compile_for_sm90a(factored):
    from tileport.ops.kda import triton_kernels as kk

    out = compile_case(CompileCase(f"kda output {'factored' if factored else 'exact'}", kk._kda_output_kernel,
                                   _kda_output_args(factored), num_warps=4, options={"num_stages": 1}))
    solve_args = dict(_args(False), G_ptr=T([Ntok, H, K], f64), PER_CHANNEL=True, FACTORED_DIAGONAL=factored)
    solve = compile_case(CompileCase(f"kda solve_wu {'factored' if factored else 'exact'}", tk._solve_wu_kernel.fn,
                                     solve_args, num_warps=8, options={"num_stages": 1}))
    for report in (out, solve):
        print(f"\n{report.summary()}")
        assert report.target_line is not None and "sm_90a" in report.target_line, report.target_line
        assert "mma" in report.ptx, "no tensor-core instruction in the PTX"


@pytest.mark.parametrize("gate_sums", [f64, f32], ids=["G-fp64", "G-fp32"])
@pytest.mark.parametrize("recompute", [False, True], ids=["forward", "recompute"])
def test_kda_whole_chunk_forward_compiles_for_sm90a(recompute, gate_sums):
    """DIAGONAL_FORM "chunk": stage 3 in GDN's tile kernel with PER_CHANNEL (the forward's and the
    backward's recompute's precisions), also forming G itself (CUMSUM_FORM "stage-3"), the block
    kernel for the flagged chunks only, and (the forward) the output kernel's two routes, each as
    launched, with G in fp64 or (GATE_SUMS_16BIT "fp32") fp32; the whole-chunk kernels without spills."""
    from tileport.ops.kda import triton_kernels as kk

    flags = dict(flags_ptr=T([NC, H], torch.int8))
    worklist = dict(flags_ptr=T([1 + NC * H], torch.int32))  # the flagged routes' (`flagged_worklist`)
    precs = dict(PREC=tk.RECOMPUTE_NORMALISED_KEYS_PREC, DIAG_PREC=tk.RECOMPUTE_NORMALISED_KEYS_DIAG_PREC) if recompute \
        else dict(PREC=tk.NORMALISED_KEYS_PREC, DIAG_PREC=tk.NORMALISED_KEYS_DIAG_PREC)
    args = dict(_args(recompute), G_ptr=T([Ntok, H, K], gate_sums), **flags)
    if recompute:  # the backward's normalised keys are fp32
        args["k_ptr"] = T([Ntok, H, K], f32)
    cases = [(CompileCase(f"kda tile solve {'recompute' if recompute else 'forward'}", tk._solve_wu_tile_kernel.fn,
                          dict(args, PER_CHANNEL=True, **precs), num_warps=8, options={"num_stages": 1}), 0),
             (CompileCase(f"kda tile solve {'recompute' if recompute else 'forward'}, G formed in it",
                          tk._solve_wu_tile_kernel.fn,
                          dict(args, PER_CHANNEL=True, g_ptr=T([Ntok, H, K], f32), CUMSUM_G=True, **precs),
                          num_warps=8, options={"num_stages": 1}), 0),
             (CompileCase("kda block solve, flagged chunks", tk._solve_wu_kernel.fn,
                          dict(args, PER_CHANNEL=True, FACTORED_DIAGONAL=True, ONLY_FLAGGED=True, **worklist), num_warps=8,
                          options={"num_stages": 1}), None)]
    if not recompute:
        # the gluon backend's "fused-t" forward: T alone (WITH_WU off), and with the keys normalised
        # and stored by stage 3 (KEYS_NORMALISED_IN "stage-3", flagged chunks' keys included)
        t_alone = dict(args, PER_CHANNEL=True, g_ptr=T([Ntok, H, K], f32), CUMSUM_G=True, STORE_T=True, WITH_WU=False,
                       **precs)
        cases += [(CompileCase("kda tile solve forward, T alone", tk._solve_wu_tile_kernel.fn, t_alone, num_warps=8,
                               options={"num_stages": 1}), 0),
                  (CompileCase("kda tile solve forward, T alone, keys normalised in it", tk._solve_wu_tile_kernel.fn,
                               dict(t_alone, eps=1e-6, L2NORM_K=True, kn_ptr=T([Ntok, H, K], bf), STORE_KN=True),
                               num_warps=8, options={"num_stages": 1}), 0),
                  (CompileCase("kda block solve, flagged chunks, T alone", tk._solve_wu_kernel.fn,
                               dict(args, PER_CHANNEL=True, FACTORED_DIAGONAL=True, ONLY_FLAGGED=True, STORE_T=True,
                                    WITH_WU=False, **worklist), num_warps=8, options={"num_stages": 1}), None)]
        BK, BV, NV = tk._blocks(K, V)
        BVW = min(kk.OUTPUT_CHUNK_BV, BV * NV)
        cases += [(CompileCase("kda output, whole chunks", kk._kda_output_kernel,
                               dict(_kda_output_args(True), BV=BVW, NV=V // BVW, CHUNKS="whole", G_ptr=args["G_ptr"],
                                    **flags),
                               num_warps=kk.OUTPUT_CHUNK_WARPS, options={"num_stages": 1}), None),
                  (CompileCase("kda output, flagged chunks", kk._kda_output_kernel,
                               dict(_kda_output_args(True), CHUNKS="flagged", G_ptr=args["G_ptr"], **worklist), num_warps=4,
                               options={"num_stages": 1}), None)]
    for case, spill_bound in cases:
        report = compile_case(case)
        print(f"\n{report.summary()}")
        assert report.target_line is not None and "sm_90a" in report.target_line, report.target_line
        assert "mma" in report.ptx, "no tensor-core instruction in the PTX"
        if spill_bound is not None:
            assert report.n_spills is not None and report.n_spills <= spill_bound, report.summary()


@pytest.mark.parametrize("l2norm_k", [False, True], ids=["keys-stage-1", "keys-in-kernel"])
def test_gdn_fused_states_output_compiles_for_sm90a(l2norm_k):
    """The forward's default stages 5+6 (FUSE_OUTPUT), and with keys normalised on load
    (L2NORM_K_FORM), at the first states candidate."""
    BK, BV, NV = tk._blocks(K, V)
    N = 8
    o = tk.STATES_OPTIONS[0]
    args = dict(k_ptr=T([Ntok, H, K], bf), w_ptr=T([Ntok, H, K], bf), u_ptr=T([Ntok, H, V], bf),
                G_ptr=T([Ntok, H], f64), h0_ptr=T([N, H, K, V], f32), h_ptr=T([NC, H, K, V], bf),
                vn_ptr=T([Ntok, H, V], bf), ht_ptr=T([N, H, K, V], f32), cu_ptr=T([N + 1], idx), choff_ptr=T([N], idx),
                H=H, NH_BUCKET=128, q_ptr=T([Ntok, H, K], bf), o_ptr=T([Ntok, H, V], bf), scale=0.1, eps=1e-6,
                K=K, V=V, BK=BK, BV=o["BV"], BT=64, HAS_H0=True, STORE_FINAL=True, DT=tl.bfloat16, DA=tl.bfloat16,
                PER_CHANNEL=False, FUSE_OUTPUT=True, L2NORM_Q=True, L2NORM_K=l2norm_k)
    report = compile_case(CompileCase(f"gdn states+output fused l2norm_k={l2norm_k}", tk._states_kernel.fn, args,
                                      num_warps=o["num_warps"], options={"num_stages": o["num_stages"]}))
    print(f"\n{report.summary()}")
    assert report.target_line is not None and "sm_90a" in report.target_line, report.target_line
    assert "mma" in report.ptx, "no tensor-core instruction in the PTX"


def _backward_cases():
    """GDN's backward kernels as the backward of bf16 inputs launches them: the products dg and
    dbeta read at `_products(bf16, True)`'s precision (BACKWARD_PRODUCTS on fp32 operands: "tf32",
    one tf32 tensor-core product, or "bf16x3", three bf16 ones)."""
    BK, BV, NV = tk._blocks(K, V)
    BKS, NK = tk._key_split(K)
    N = 8
    DT, DA, PREC = tk._products(bf, for_backward=True)
    tok = lambda d, t=bf: T([Ntok, H, d], t)  # noqa: E731
    common = dict(H=H, K=K, BT=64, DT=DT, DA=DA, PREC=PREC)
    seq = dict(cu_ptr=T([N + 1], idx), choff_ptr=T([N], idx), NH_BUCKET=128)
    d = tk.DSTATES_OPTIONS[0]
    s = tk.STATES_OPTIONS[0]
    yield "states (recompute)", tk._states_kernel.fn, s, dict(
        k_ptr=tok(K, f32), w_ptr=tok(K, f32), u_ptr=tok(V, f32), G_ptr=T([Ntok, H], f64), h0_ptr=T([N, H, K, V], f32),
        h_ptr=T([NC, H, K, V], f32), vn_ptr=tok(V, f32), ht_ptr=T([N, H, K, V], f32), q_ptr=tok(V, f32), o_ptr=tok(V, f32),
        scale=0.1, eps=1e-6, V=V, BK=BK, BV=s["BV"], HAS_H0=True, STORE_FINAL=False, PER_CHANNEL=False,
        FUSE_OUTPUT=False, L2NORM_Q=False, **seq, **common)
    yield "dv_local", tk._dv_local_kernel, dict(tk._LAUNCH["dv_local"], num_stages=1), dict(
        q_ptr=tok(K, f32), k_ptr=tok(K, f32), G_ptr=T([Ntok, H], f64), do_ptr=tok(V), dvl_ptr=tok(V, f32),
        chunks_ptr=T([2 * NC], idx), scale=0.1, V=V, BK=BK, BV=BV, NV=NV, **common)
    yield "dstates", tk._dstates_kernel.fn, d, dict(
        q_ptr=tok(K, f32), k_ptr=tok(K, f32), w_ptr=tok(K, f32), G_ptr=T([Ntok, H], f64), do_ptr=tok(V), dvl_ptr=tok(V, f32),
        dht_ptr=T([N, H, K, V], f32), dh_ptr=T([NC, H, K, V], f32), dvn_ptr=tok(V, f32), dh0_ptr=T([N, H, K, V], f32),
        scale=0.1, V=V, BK=BK, BV=d["BV"], HAS_DHT=True, STORE_DH0=True, **seq, **common)
    # KDA's BACKWARD_DSTATES_DTYPE "bf16": dh and dVn stored rounded to bf16
    yield "dstates (bf16 dh and dVn)", tk._dstates_kernel.fn, d, dict(
        q_ptr=tok(K, f32), k_ptr=tok(K, f32), w_ptr=tok(K, f32), G_ptr=T([Ntok, H], f64), do_ptr=tok(V), dvl_ptr=tok(V, f32),
        dht_ptr=T([N, H, K, V], f32), dh_ptr=T([NC, H, K, V], bf), dvn_ptr=tok(V, bf), dh0_ptr=T([N, H, K, V], f32),
        scale=0.1, V=V, BK=BK, BV=d["BV"], HAS_DHT=True, STORE_DH0=True, **seq, **common)
    for ds_here in (True, False):  # DQKWG_FORM "one" and "split"'s second kernel
        yield f"dqkwg{'' if ds_here else ' (split: state part)'}", tk._dqkwg_kernel, dict(tk._LAUNCH["dqkwg"], num_stages=1), dict(
            q_ptr=tok(K, f32), k_ptr=tok(K, f32), G_ptr=T([Ntok, H], f64), h_ptr=T([NC, H, K, V], f32),
            dh_ptr=T([NC, H, K, V], f32), vn_ptr=tok(V, f32), dvn_ptr=tok(V, f32), do_ptr=tok(V), dql_ptr=tok(K, f32),
            dkl_ptr=tok(K, f32), dq_ptr=tok(K, f32), dk_ptr=tok(K, f32), dw_ptr=tok(K, f32), dG_ptr=T([NK, Ntok, H], f32),
            chunks_ptr=T([2 * NC], idx), scale=0.1, dG_stride=Ntok * H, V=V, BKS=BKS, BV=BV, NV=NV, DS_HERE=ds_here,
            **common)
    yield "dqk_local (split: chunk-local part)", tk._dqk_local_kernel, dict(tk._LAUNCH["dqkwg"], num_stages=1), dict(
        q_ptr=tok(K, f32), k_ptr=tok(K, f32), G_ptr=T([Ntok, H], f64), vn_ptr=tok(V, f32), do_ptr=tok(V),
        dql_ptr=tok(K, f32), dkl_ptr=tok(K, f32), dG_ptr=T([Ntok, H], f32), chunks_ptr=T([2 * NC], idx), scale=0.1,
        V=V, BKS=BKS, BV=BV, NV=NV, **common)
    for phase in ("all", "da", "apply"):  # WY_BWD_FORM "one", and "split"'s two halves
        yield f"wy_bwd{'' if phase == 'all' else f' (split: {phase})'}", tk._wy_bwd_kernel, dict(tk._LAUNCH["wy_bwd"], num_stages=1), dict(
            k_ptr=tok(K, f32), v_ptr=tok(V), beta_ptr=T([Ntok, H], bf), G_ptr=T([Ntok, H], f64), Ai_ptr=tok(64, f32),
            w_ptr=tok(K, f32), u_ptr=tok(V, f32), dw_ptr=tok(K, f32), dvn_ptr=tok(V, f32), dkp_ptr=tok(K, f32),
            dGp_ptr=T([NK, Ntok, H], f32), dk_ptr=tok(K, f32), dv_ptr=tok(V), dbeta_ptr=T([Ntok, H], bf),
            dg_ptr=T([Ntok, H], f32), da_ptr=tok(64, f32), dat_ptr=tok(64, f32), vdu_ptr=T([Ntok, H], f32),
            chunks_ptr=T([2 * NC], idx), dGp_stride=Ntok * H, V=V, BK=BK, BV=BV, NV=NV, NKP=NK,
            BKW=min(BK, tk.WY_BWD_KEY_BLOCK), PHASE=phase, **common)


BACKWARD_CASES = list(_backward_cases())


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=[c[0] for c in BACKWARD_CASES])
def test_gdn_backward_compiles_for_sm90a(case):
    name, fn, launch, args = case
    prec = tk.BACKWARD_PRODUCTS
    assert args["PREC"] == prec in ("tf32", "bf16x3"), "the backward of bf16 inputs should multiply fp32 operands at BACKWARD_PRODUCTS"
    report = compile_case(CompileCase(f"gdn {name}", fn, args, num_warps=launch["num_warps"],
                                      options={"num_stages": launch["num_stages"]}))
    print(f"\n{report.summary()}")
    assert report.target_line is not None and "sm_90a" in report.target_line, report.target_line
    # tf32 lowers to tf32 tensor-core products, bf16x3 to bf16 ones: an fp32 product on FMA units would have none
    kind = "tf32" if prec == "tf32" else "bf16"
    assert any(kind in line for line in report.ptx.splitlines() if "mma" in line), f"no {kind} tensor-core product"


def _kda_backward_cases():
    """KDA's backward kernels (per-channel gates) as the backward of bf16 inputs launches them:
    their static block loops and constexpr block indices must lower, which the interpreter never checks."""
    from tileport.ops.kda import triton_kernels as kk

    BK, BV, NV = tk._blocks(K, V)
    DT, DA, PREC = tk._products(bf, for_backward=True)
    tok = lambda d, t=f32: T([Ntok, H, d], t)  # noqa: E731
    Gc = T([Ntok, H, K], f64)
    ch = T([2 * NC], idx)
    prec = dict(PREC=PREC, DT=DT, DA=DA)
    for factored in (False, True):  # DIAGONAL_FORM: the factored path is a run-time branch beside the exact one
        tag = " factored" if factored else ""
        yield "kda dv_local" + tag, kk._kda_dv_local_kernel, dict(
            q_ptr=tok(K), k_ptr=tok(K), G_ptr=Gc, do_ptr=tok(V, bf), dvl_ptr=tok(V), chunks_ptr=ch, H=H, scale=0.1,
            K=K, V=V, BK=BK, BV=BV, NV=NV, BT=64, FACTORED=factored, **prec)
        yield "kda dp apply" + tag, kk._kda_dp_apply_kernel, dict(
            dp_ptr=tok(64), q_ptr=tok(K), k_ptr=tok(K), G_ptr=Gc, dq_ptr=tok(K), dk_ptr=tok(K), dG_ptr=tok(K),
            chunks_ptr=ch, H=H, K=K, BK=BK, BT=64, FACTORED=factored, **prec)
        yield "kda da apply" + tag, kk._kda_da_apply_kernel, dict(
            da_ptr=tok(64), k_ptr=tok(K), beta_ptr=T([Ntok, H], bf), G_ptr=Gc, dkp_ptr=tok(K), dGp_ptr=tok(K),
            dbp_ptr=T([Ntok, H], f32), dk_ptr=tok(K), dbeta_ptr=T([Ntok, H], bf), dg_ptr=tok(K), chunks_ptr=ch, H=H,
            K=K, BK=BK, BT=64, FACTORED=factored, **prec)
    # DIAGONAL_FORM "chunk": each kernel's two routes on the recompute's flags (the whole chunks on
    # WHOLE_CHUNK_WARPS; their static returns and whole-chunk helpers must lower)
    flags = dict(FACTORED=True, flags_ptr=T([NC, H], torch.int8))
    yield "kda dv_local whole BV128", kk._kda_dv_local_kernel, dict(  # DV_LOCAL_WHOLE_BV 128: one program per chunk
        q_ptr=tok(K), k_ptr=tok(K), G_ptr=tok(K), do_ptr=tok(V, bf), dvl_ptr=tok(V), chunks_ptr=ch, H=H, scale=0.1,
        K=K, V=V, BK=BK, BV=128, NV=V // 128, BT=64, CHUNKS="whole", **flags, **prec)
    yield "kda dv_local whole BV128 raw q, k", kk._kda_dv_local_kernel, dict(  # DV_LOCAL_RAW_QK: bf16 q and k
        q_ptr=tok(K, bf), k_ptr=tok(K, bf), G_ptr=tok(K), do_ptr=tok(V, bf), dvl_ptr=tok(V), chunks_ptr=ch, H=H,
        scale=0.1, K=K, V=V, BK=BK, BV=128, NV=V // 128, BT=64, CHUNKS="whole", L2NORM_QK=True, eps=1e-6, **flags,
        **prec)
    work = T([1 + NC * H], torch.int32)  # BACKWARD_FLAGGED_WORKLIST: the flagged routes over their worklist
    for route in ("whole", "flagged", "worklist"):
        if route == "worklist":
            flags = dict(flags, work_ptr=work)
        yield f"kda dv_local {route}", kk._kda_dv_local_kernel, dict(
            q_ptr=tok(K), k_ptr=tok(K), G_ptr=Gc, do_ptr=tok(V, bf), dvl_ptr=tok(V), chunks_ptr=ch, H=H, scale=0.1,
            K=K, V=V, BK=BK, BV=BV, NV=NV, BT=64, CHUNKS=route, **flags, **prec)
        yield f"kda dp apply {route}", kk._kda_dp_apply_kernel, dict(
            dp_ptr=tok(64), q_ptr=tok(K), k_ptr=tok(K), G_ptr=Gc, dq_ptr=tok(K), dk_ptr=tok(K), dG_ptr=tok(K),
            chunks_ptr=ch, H=H, K=K, BK=BK, BT=64, CHUNKS=route, **flags, **prec)
        yield f"kda da apply {route}", kk._kda_da_apply_kernel, dict(
            da_ptr=tok(64), k_ptr=tok(K), beta_ptr=T([Ntok, H], bf), G_ptr=Gc, dkp_ptr=tok(K), dGp_ptr=tok(K),
            dbp_ptr=T([Ntok, H], f32), dk_ptr=tok(K), dbeta_ptr=T([Ntok, H], bf), dg_ptr=tok(K), chunks_ptr=ch, H=H,
            K=K, BK=BK, BT=64, CHUNKS=route, **flags, **prec)
    yield "kda dqkwg", kk._kda_dqkwg_kernel, dict(
        q_ptr=tok(K), k_ptr=tok(K), G_ptr=Gc, h_ptr=T([NC, H, K, V], f32), dh_ptr=T([NC, H, K, V], f32),
        vn_ptr=tok(V), dvn_ptr=tok(V), do_ptr=tok(V, bf), dq_ptr=tok(K), dk_ptr=tok(K), dw_ptr=tok(K), dG_ptr=tok(K),
        dp_ptr=tok(64), chunks_ptr=ch, H=H, scale=0.1, K=K, V=V, BKS=tk._key_split(K)[0], BV=BV, NV=NV, BT=64, **prec)
    yield "kda wy_bwd", kk._kda_wy_bwd_kernel, dict(
        k_ptr=tok(K), v_ptr=tok(V, bf), beta_ptr=T([Ntok, H], bf), G_ptr=Gc, Ai_ptr=tok(64), w_ptr=tok(K),
        u_ptr=tok(V), dw_ptr=tok(K), dvn_ptr=tok(V), dkp_ptr=tok(K), dGp_ptr=tok(K), da_ptr=tok(64),
        dbp_ptr=T([Ntok, H], f32), dv_ptr=tok(V, bf), chunks_ptr=ch, H=H, K=K, V=V, BK=BK, BV=BV, NV=NV, BT=64,
        **prec)
    # 9b's and 10b's whole-chunk routes fused into 9 and 10 (BACKWARD_FUSED_PAIRS), G in fp32 as the
    # backward of 16-bit inputs stores it (GATE_SUMS_16BIT)
    G32, fl = tok(K), T([NC, H], torch.int8)
    yield "kda dqkwg fused 9b", kk._kda_dqkwg_kernel, dict(
        q_ptr=tok(K), k_ptr=tok(K), G_ptr=G32, h_ptr=T([NC, H, K, V], f32), dh_ptr=T([NC, H, K, V], f32),
        vn_ptr=tok(V), dvn_ptr=tok(V), do_ptr=tok(V, bf), dq_ptr=tok(K), dk_ptr=tok(K), dw_ptr=tok(K), dG_ptr=tok(K),
        dp_ptr=tok(64), chunks_ptr=ch, H=H, scale=0.1, K=K, V=V, BKS=tk._key_split(K)[0], BV=BV, NV=NV, BT=64,
        PAIRS=True, flags_ptr=fl, dp_stride=Ntok * H * 64, **prec)
    yield "kda wy_bwd fused 10b", kk._kda_wy_bwd_kernel, dict(
        k_ptr=tok(K), v_ptr=tok(V, bf), beta_ptr=T([Ntok, H], bf), G_ptr=G32, Ai_ptr=tok(64), w_ptr=tok(K),
        u_ptr=tok(V), dw_ptr=tok(K), dvn_ptr=tok(V), dkp_ptr=tok(K), dGp_ptr=tok(K), da_ptr=tok(64),
        dbp_ptr=T([Ntok, H], f32), dv_ptr=tok(V, bf), chunks_ptr=ch, H=H, K=K, V=V, BK=BK, BV=BV, NV=NV, BT=64,
        CB=min(BK, 64), PAIRS=True, flags_ptr=fl, dk_ptr=tok(K), dbeta_ptr=T([Ntok, H], bf), dg_ptr=tok(K), **prec)
    # their flagged chunks' launches beside the Gluon kernels (the whole-chunk pair terms compiled
    # out), on a grid of every chunk or over the worklist (BACKWARD_FLAGGED_WORKLIST)
    for route, extra in (("flagged", {}), ("worklist", dict(work_ptr=work))):
        yield f"kda dqkwg fused 9b {route}", kk._kda_dqkwg_kernel, dict(
            q_ptr=tok(K), k_ptr=tok(K), G_ptr=G32, h_ptr=T([NC, H, K, V], f32), dh_ptr=T([NC, H, K, V], f32),
            vn_ptr=tok(V), dvn_ptr=tok(V), do_ptr=tok(V, bf), dq_ptr=tok(K), dk_ptr=tok(K), dw_ptr=tok(K),
            dG_ptr=tok(K), dp_ptr=tok(64), chunks_ptr=ch, H=H, scale=0.1, K=K, V=V, BKS=tk._key_split(K)[0], BV=BV,
            NV=NV, BT=64, PAIRS=True, flags_ptr=fl, dp_stride=Ntok * H * 64, CHUNKS=route, **extra, **prec)
        yield f"kda wy_bwd fused 10b {route}", kk._kda_wy_bwd_kernel, dict(
            k_ptr=tok(K), v_ptr=tok(V, bf), beta_ptr=T([Ntok, H], bf), G_ptr=G32, Ai_ptr=tok(64), w_ptr=tok(K),
            u_ptr=tok(V), dw_ptr=tok(K), dvn_ptr=tok(V), dkp_ptr=tok(K), dGp_ptr=tok(K), da_ptr=tok(64),
            dbp_ptr=T([Ntok, H], f32), dv_ptr=tok(V, bf), chunks_ptr=ch, H=H, K=K, V=V, BK=BK, BV=BV, NV=NV, BT=64,
            CB=min(BK, 64), PAIRS=True, flags_ptr=fl, dk_ptr=tok(K), dbeta_ptr=T([Ntok, H], bf), dg_ptr=tok(K),
            CHUNKS=route, **extra, **prec)
    # 16-bit states (KEPT_STATES_DTYPE "bf16", BACKWARD_DSTATES_DTYPE "bf16"): h, dh, Vn and dVn in
    # bf16, widened on load; the flagged chunks' launches over the worklist beside the Gluon kernels
    st16 = dict(h_ptr=T([NC, H, K, V], bf), dh_ptr=T([NC, H, K, V], bf), vn_ptr=tok(V, bf), dvn_ptr=tok(V, bf))
    yield "kda dqkwg fused 9b worklist 16-bit states", kk._kda_dqkwg_kernel, dict(
        q_ptr=tok(K), k_ptr=tok(K), G_ptr=G32, do_ptr=tok(V, bf), dq_ptr=tok(K), dk_ptr=tok(K), dw_ptr=tok(K),
        dG_ptr=tok(K), dp_ptr=tok(64), chunks_ptr=ch, H=H, scale=0.1, K=K, V=V, BKS=tk._key_split(K)[0], BV=BV,
        NV=NV, BT=64, PAIRS=True, flags_ptr=fl, dp_stride=Ntok * H * 64, CHUNKS="worklist", work_ptr=work, **st16,
        **prec)
    # U never formed (BACKWARD_U_FROM_T): the flagged chunks' launch over the worklist, u_ptr None (and with
    # stage 8's dVn in bf16)
    for dvn_dtype in (f32, bf):
        yield f"kda wy_bwd fused 10b worklist u-free{' bf16 dVn' if dvn_dtype == bf else ''}", kk._kda_wy_bwd_kernel, dict(
            k_ptr=tok(K), v_ptr=tok(V, bf), beta_ptr=T([Ntok, H], bf), G_ptr=G32, Ai_ptr=tok(64), w_ptr=tok(K),
            u_ptr=None, dw_ptr=tok(K), dvn_ptr=tok(V, dvn_dtype), dkp_ptr=tok(K), dGp_ptr=tok(K), da_ptr=tok(64),
            dbp_ptr=T([Ntok, H], f32), dv_ptr=tok(V, bf), chunks_ptr=ch, H=H, K=K, V=V, BK=BK, BV=BV, NV=NV, BT=64,
            CB=min(BK, 64), PAIRS=True, flags_ptr=fl, dk_ptr=tok(K), dbeta_ptr=T([Ntok, H], bf), dg_ptr=tok(K),
            CHUNKS="worklist", work_ptr=work, U_FREE=True, **prec)

KDA_BACKWARD_CASES = list(_kda_backward_cases())


@pytest.mark.parametrize("case", KDA_BACKWARD_CASES, ids=[c[0] for c in KDA_BACKWARD_CASES])
def test_kda_backward_compiles_for_sm90a(case):
    name, fn, args = case
    from tileport.ops.kda import triton_kernels as kk

    warps = (kk.WHOLE_CHUNK_WARPS if name.endswith(" whole") or " whole " in name else
             (kk._LAUNCH_CHUNK if name.startswith(("kda dqkwg", "kda wy_bwd")) else kk._LAUNCH_BACKWARD)["num_warps"])
    report = compile_case(CompileCase(name, fn, args, num_warps=warps, options={"num_stages": 1}))
    print(f"\n{report.summary()}")
    assert report.target_line is not None and "sm_90a" in report.target_line, report.target_line
    kind = "tf32" if tk.BACKWARD_PRODUCTS == "tf32" else "bf16"  # GDN's BACKWARD_PRODUCTS, shared by KDA
    assert any(kind in line for line in report.ptx.splitlines() if "mma" in line), f"no {kind} tensor-core product"


# The grouped GEMM's autotune candidates (GEMM_OPTIONS) as the forward launches them (bf16, TMA
# descriptors): each must lower to WGMMA and TMA for sm_90a, fit the CTA's shared memory and keep
# its accumulator in registers.
@pytest.mark.parametrize("dt", [bf, f32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("index", range(len(__import__("tileport.ops.grouped_gemm.triton_kernels",
                                                       fromlist=["GEMM_OPTIONS"]).GEMM_OPTIONS)))
def test_grouped_gemm_candidates_compile_for_sm90a(index, dt):
    """... and `candidate_fits` (the autotuner's pruning) agrees with ptxas on which fit."""
    from tileport.ops.grouped_gemm import triton_kernels as gk

    o = gk.GEMM_OPTIONS[index]
    G, M, Kd, N = 8, 2048, 4096, 4096
    args = dict(table_ptr=T([G, 5], torch.int64), tiles_ptr=T([G * M // 128, 2], idx), like_ptr=T([G * M, N], dt),
                Np=N, n_row_tiles=G * M // 128, ROWS_BUCKET=128, K_BUCKET=Kd, sam=Kd, sak=1, sbk=N, sbn=1, scm=N,
                BM=gk._GPU_BLOCKS["BM"], BN=o["BN"], BK=o["BK"], USE_DESC=True, IEEE=dt == f32, UPCAST=False, A_T=False,
                B_T=False, BAND=gk._GPU_BLOCKS["BAND"])
    report = compile_case(CompileCase(f"grouped gemm {dt} {o}", gk._grouped_gemm_kernel.fn, args,
                                      num_warps=o["num_warps"], options={"num_stages": o["num_stages"]}))
    print(f"\n{report.summary()}")
    assert report.target_line is not None and "sm_90a" in report.target_line, report.target_line
    fits = gk.candidate_fits(o, torch.finfo(dt).bits // 8)
    assert report.shared is not None and (report.shared <= 227 * 1024) == fits, \
        f"{report.shared} bytes of shared memory, candidate_fits says {fits}"
    if not fits:
        return  # pruned for this dtype: it never runs
    if dt == bf:
        assert "wgmma.mma_async" in report.ptx, "no WGMMA in the PTX"
    assert "cp.async.bulk.tensor" in report.ptx, "no TMA load in the PTX"
    assert report.n_spills is None or report.n_spills == 0, f"{report.n_spills} bytes of spills"


# rms_norm's Triton backward: every autotune candidate (BWD_OPTIONS) that `candidate_fits` keeps,
# at the row widths its forms differ in (one tile of 2-64 rows, one row, chunked rows; descriptors
# and raw pointers): no spills, PER_SM programs resident on one SM by registers and shared memory,
# ptxas's shared memory under `shared_bound`, and the tile loop software-pipelined (STAGES - 1
# tiles of x and dy in shared memory: Triton does not pipeline a loop without a dot unless asked).
RMS_BWD_WIDTHS = [(4096, bf, True), (4096, f32, True), (1024, bf, False), (1024, f32, False), (128, f32, True),
                  (8192, bf, True), (8192, f32, True), (16384, bf, True)]


@pytest.mark.parametrize("D,dt,use_desc", RMS_BWD_WIDTHS,
                         ids=[f"D{d}-{'bf16' if t == bf else 'fp32'}-{'desc' if u else 'ptr'}" for d, t, u in RMS_BWD_WIDTHS])
@pytest.mark.parametrize("index", range(len(__import__("tileport.ops.rms_norm.triton_kernels",
                                                       fromlist=["BWD_OPTIONS"]).BWD_OPTIONS)))
def test_rms_norm_backward_candidates_compile_for_sm90a(index, D, dt, use_desc):
    from tileport.ops.rms_norm import triton_kernels as rk
    from tileport.triton_rows import tile_rows

    o = rk.BWD_OPTIONS[index]
    size = torch.finfo(dt).bits // 8
    fallback = 0 if dt == bf else 4  # the first candidate, or fp32's (FP64_SUMS: fp64 tiles)
    if index == fallback:
        assert rk.candidate_fits(o, D, size), "the autotuner's fallback for this dtype must fit every width"
    if not rk.candidate_fits(o, D, size):
        return  # pruned for this width and dtype: it never runs
    M = 8192
    block_d, one_tile = rk.bwd_row_width(D, size)
    args = dict(x_ptr=T([M, D], dt), w_ptr=T([D], dt), dy_ptr=T([M, D], dt), dx_ptr=T([M, D], dt),
                dw_part_ptr=T([132, D], f32), M=M, D=D, D_BUCKET=block_d, stride_x=D, stride_dy=D, stride_dx=D,
                eps=1e-6, BLOCK_D=block_d, ONE_TILE=one_tile, USE_DESC=use_desc, HAS_WEIGHT=True, WANT_DW=True,
                TILE=o["TILE"], STAGES=o["STAGES"], PER_SM=o["PER_SM"], FP64_SUMS=dt == f32)
    report = compile_case(CompileCase(f"rms_norm bwd D={D} {dt} desc={use_desc} {o}", rk._rms_norm_bwd_kernel.fn, args,
                                      num_warps=o["num_warps"], options={"num_stages": o["num_stages"]}))
    print(f"\n{report.summary()}")
    assert report.target_line is not None and "sm_90a" in report.target_line, report.target_line
    assert report.n_spills is None or report.n_spills == 0, f"{report.n_spills} bytes of spills"
    threads = 32 * o["num_warps"]
    assert report.n_regs * threads * o["PER_SM"] <= 65536, f"{report.n_regs} registers: {o['PER_SM']} CTAs do not fit"
    assert report.shared <= rk.shared_bound(o, D, size), f"{report.shared} B over shared_bound"
    assert report.shared * o["PER_SM"] <= 227 * 1024, f"{report.shared} B: {o['PER_SM']} CTAs do not fit"
    assert ("cp.async.bulk.tensor" if use_desc else "cp.async.cg") in report.ptx, "no TMA / cp.async load"
    if one_tile and o["STAGES"] > 1:
        tile_bytes = tile_rows(o["TILE"], block_d) * block_d * size
        assert report.shared >= 2 * (o["STAGES"] - 1) * tile_bytes, f"{report.shared} B: the tile loop is not pipelined"


@pytest.mark.parametrize("dt", [bf, f32], ids=["bf16", "fp32"])
def test_rms_norm_backward_compiles_at_d1(dt):
    """D = 1, which Triton specialises to a constexpr at launch (the kernel's fp64 1 / D once failed
    there: a Python int has no .to), in each dtype's fallback candidate."""
    from tileport.ops.rms_norm import triton_kernels as rk

    size = torch.finfo(dt).bits // 8
    o = rk.BWD_OPTIONS[0 if dt == bf else 4]
    block_d, one_tile = rk.bwd_row_width(1, size)
    args = dict(x_ptr=T([64, 1], dt), w_ptr=T([1], dt), dy_ptr=T([64, 1], dt), dx_ptr=T([64, 1], dt),
                dw_part_ptr=T([132, 1], f32), M=64, D=1, D_BUCKET=block_d, stride_x=1, stride_dy=1, stride_dx=1,
                eps=1e-6, BLOCK_D=block_d, ONE_TILE=one_tile, USE_DESC=False, HAS_WEIGHT=True, WANT_DW=True,
                TILE=o["TILE"], STAGES=o["STAGES"], PER_SM=o["PER_SM"], FP64_SUMS=dt == f32)
    report = compile_case(CompileCase(f"rms_norm bwd D=1 {dt}", rk._rms_norm_bwd_kernel.fn, args,
                                      num_warps=o["num_warps"], options={"num_stages": o["num_stages"]}))
    assert report.target_line is not None and "sm_90a" in report.target_line, report.target_line
    assert report.n_spills is None or report.n_spills == 0, f"{report.n_spills} bytes of spills"


def test_rms_norm_dw_sum_compiles_for_sm90a():
    """triton_rows.sum_partial_rows' kernel at 132 partial rows of 4096 into bf16: no spills."""
    from tileport import triton_rows

    P, D = 132, 4096
    args = dict(part_ptr=T([P, D], f32), out_ptr=T([D], bf), P=P, D=D, BLOCK_P=256, BLOCK_D=triton_rows._PARTIAL_COLS)
    report = compile_case(CompileCase("rms_norm dw sum", triton_rows._sum_partial_rows_kernel, args, num_warps=4))
    print(f"\n{report.summary()}")
    assert report.n_spills is None or report.n_spills == 0, f"{report.n_spills} bytes of spills"


def test_flagged_worklist_kernel_compiles_for_sm90a():
    """The flagged routes' worklist (`_flagged_worklist_kernel`: a prefix sum over stage 3's flags)."""
    report = compile_case(CompileCase("flagged worklist", tk._flagged_worklist_kernel,
                                      dict(flags_ptr=T([NC * H], torch.int8), work_ptr=T([1 + NC * H], torch.int32),
                                           n=NC * H, BLOCK=1024), num_warps=4))
    print(f"\n{report.summary()}")
    assert report.target_line is not None and "sm_90a" in report.target_line, report.target_line
    assert report.n_spills == 0, report.summary()
