"""A/B of the forms of GDN's forward stages on the H200, at S1 (B=8, T=4096, H=16, K=V=128, bf16):
stage 3 (T, W, U), `_solve_wu_kernel` (16x16 block chain) against `_solve_wu_tile_kernel` (whole
[64, 64] tiles); stage 6 (the output), every Triton candidate (one-shot and persistent) and
both Gluon kernels (one-shot and persistent, two TMA buffer sets); and stages 5 + 6 split (the
states kernel stores h and Vn, the output kernel reads them) against fused (STATES_FORM); the
whole forward with its switches; the whole backward in each BACKWARD_PRODUCTS. Stages 5 + 6 also
time the Gluon fused recurrence + output kernel (`gluon_kernels._states_output_kernel`).

    python3 scripts/gdn_ab.py            (on the GPU; ~1-2 min, most of it compiling)

Each kernel is launched directly at fixed launch options (no autotuning), forward form (bf16
W/U, no T) and backward-recompute form (T stored, fp32 W/U from fp32 operands), timed with
do_bench (median, CUDA events) on the same inputs, once with l2-normalised keys (the bench's
inputs) and once with raw N(0, 1) keys (large A entries: the harder case for the solve's
precision). Accuracy: T against a float64 inverse of (I + A) over a sample of chunks, and W, U
of the tile form against the block form.
"""

import os

import torch
import triton
import triton.testing

from tileport.ops.gdn import triton_kernels as tk

B, T, H, K, V = 8, 4096, 16, 128, 128
dev = "cuda"
if not torch.cuda.is_available():  # a dry run of the script's logic (TRITON_INTERPRET=1): tiny, untimed
    B, T, H, K, V, dev = 1, 256, 2, 32, 32, "cpu"
torch.manual_seed(0)
BK, BV, NV = tk._blocks(K, V)
DT, DA = tk._dot_types(torch.bfloat16)
plan = tk.make_plan(B, T, None, dev)
# GDN_AB_SECTIONS picks what to time (comma-separated; default all): solve, output, states, forward, gluon,
# backward, dstates, dqkwg, wy, dqk
_ALL = ("solve", "output", "states", "forward", "gluon", "backward", "dstates", "dqkwg", "wy", "dqk")
SECTIONS = [x.strip() for x in os.environ.get("GDN_AB_SECTIONS", ",".join(_ALL)).split(",")]
if set(SECTIONS) - set(_ALL):
    raise SystemExit(f"GDN_AB_SECTIONS: unknown {sorted(set(SECTIONS) - set(_ALL))}")
DEFAULTS = (tk.SOLVE_FORM, tk.STATES_FORM, tk.NORMALISED_KEYS_PREC, tk.L2NORM_K_FORM, tk.BACKWARD_PRODUCTS, tk.WU_FORM,
            tk.CUMSUM_FORM, tk.T_CHAIN)
Ntok = B * T


def inputs(normalised: bool):
    k = torch.randn(Ntok, H, K, device=dev)
    if normalised:
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(Ntok, H, V, device=dev, dtype=torch.bfloat16)
    beta = torch.sigmoid(torch.randn(Ntok, H, device=dev)).to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(Ntok, H, device=dev))
    return k.to(torch.bfloat16), v, beta, tk.chunk_cumsum(g, plan)


def launch(form, prec, warps, backward, k, v, beta, G, diag="ieee"):
    inter = torch.float32 if backward else torch.bfloat16
    Ai = torch.empty(Ntok, H, 64, device=dev) if backward else None
    w = torch.empty(Ntok, H, K, device=dev, dtype=inter)
    u = torch.empty(Ntok, H, V, device=dev, dtype=inter)
    grid = (plan.NC, H)
    common = (k, v, beta, G, Ai if backward else w, w, u, plan.chunks, H, K, V, BK, BV, NV, 64, DT, DA)
    if form == "blocks":
        fn = lambda: tk._solve_wu_kernel.fn[grid](*common, False, backward, backward,  # noqa: E731
                                                   num_warps=warps, num_stages=1)
    else:
        fn = lambda: tk._solve_wu_tile_kernel.fn[grid](*common, prec, backward, backward,  # noqa: E731
                                                        DIAG_PREC=diag, num_warps=warps, num_stages=1)
    fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    return fn, Ai, w, u


def t_reference(k, beta, G, n=None):
    """float64 T for the first n chunks of head 0."""
    out = []
    for c in range(n or min(64, Ntok // 64)):
        rows = slice(64 * c, 64 * c + 64)
        kc = k[rows, 0].double()
        gc = G[rows, 0].double()
        A = (kc @ kc.T) * beta[rows, 0].double()[:, None] * torch.exp(gc[:, None] - gc[None, :])
        A = torch.tril(A, -1)
        out.append(torch.linalg.inv(torch.eye(64, dtype=torch.float64, device=dev) + A))
    return torch.stack(out)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def stage_operands():
    """The backward's operands of stages 9 and 10 at S1 (Triton's recompute, stages 7 and 8): the
    inputs (q, k, v, g, beta, dO), their flattened forms, and qn, kn, G, T, W, U, h, Vn, dh, dVn."""
    qf, kf, vf, gf, bf_, do = backward_inputs(B, T)
    flat = [tk._flatten(x) for x in (qf, kf, vf, gf, bf_)]
    dof = tk._flatten(do)
    qn, kn, G, Ai, w, u, h, vn, _ = tk._recompute(*flat, None, True, plan, False, for_backward=True)
    dvl = tk.chunk_dv_local(qn, kn, G, dof, K ** -0.5, plan, input_dtype=torch.bfloat16)
    dh, dvn, _ = tk.chunk_dstates(qn, kn, w, G, dof, dvl, None, K ** -0.5, plan, False, input_dtype=torch.bfloat16)
    return qf, kf, vf, gf, bf_, do, flat, dof, qn, kn, G, Ai, w, u, h, vn, dh, dvn


def stage_ab(label: str, fn, ref=None, names=()) -> tuple | None:
    """One stage function timed at S1 (do_bench median), its outputs compared with ref's by name;
    a failure printed, not raised. Returns the outputs (None on failure)."""
    try:
        got = fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")
        diff = "" if ref is None else ", vs triton: " + " ".join(
            f"{n} {rel(a, b):.2e}" for n, a, b in zip(names, got, ref))
        print(f"{label}: {ms:.3f} ms{diff}", flush=True)
        return got
    except Exception as exc:
        print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return None


def whole_backward_ab(switch_name: str, settings: list, label) -> None:
    """The whole backward of the gluon backend at S1 (bench inputs) under each of `settings`, a list
    of {module: {switch: value}} (the first the baseline), timed and its gradients compared with
    the first's; label(setting) names a row. The switches are restored after."""
    from tileport.ops.gdn import gluon_kernels as gk

    qf, kf, vf, gf, bf_, do = backward_inputs(B, T)
    saved = {(m, n): getattr(m, n) for setting in settings for m, sw in setting.items() for n in sw}
    grads = {}
    try:
        for setting in settings:
            for m, sw in setting.items():
                for n, value in sw.items():
                    setattr(m, n, value)
            name = label(setting)

            def bwd():
                return gk.gdn_backward_gluon(do, None, qf, kf, vf, gf, bf_, K ** -0.5, None, True, None)

            try:
                grads[name] = bwd()
                ms = triton.testing.do_bench(bwd, warmup=5, rep=40, return_mode="median")
                first = next(iter(grads))
                diff = "" if name == first else f", vs {first}: " + " ".join(
                    f"{n} {rel(a, b):.1e}" for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), grads[name], grads[first]))
                print(f"backward S1 gluon backend, {switch_name} {name}: {ms:.3f} ms{diff}", flush=True)
            except Exception as exc:
                print(f"backward S1 {switch_name} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    finally:
        for (m, n), value in saved.items():
            setattr(m, n, value)


def backward_inputs(*lead):
    """q, k, v, g, beta and dO over leading dims `lead` (then H and the head dim): the bench's
    distributions, bf16 (g fp32)."""
    q, k = (torch.randn(*lead, H, K, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(*lead, H, V, device=dev, dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(*lead, H, device=dev))
    beta = torch.sigmoid(torch.randn(*lead, H, device=dev)).to(torch.bfloat16)
    return q, k, v, g, beta, torch.randn(*lead, H, V, device=dev, dtype=torch.bfloat16)


# the block form (8 warps: its 4-warp candidate spills), the tile form at tf32x3 (raw keys and the
# backward's recompute) on 8 and 4 warps, and at one-pass tf32 (the forward's default with
# normalised keys df3acc3-b9a387e; the recompute's option, log row 22) and bf16 (the forward's
# default since b9a387e, log row 16)
if "solve" in SECTIONS:
    # (form, products, warps, diagonal inverses): the last two with the 16x16 diagonal inverses on
    # tensor cores (NORMALISED_KEYS_DIAG_PREC, RECOMPUTE_NORMALISED_KEYS_DIAG_PREC: log rows 26, 28)
    variants = [("blocks", "ieee", 8, "ieee"), ("tile", "tf32x3", 8, "ieee"), ("tile", "tf32x3", 4, "ieee"),
                ("tile", "tf32", 8, "ieee"), ("tile", "tf32", 4, "ieee"), ("tile", "bf16", 8, "ieee"),
                ("tile", "bf16", 4, "ieee"), ("tile", "bf16", 4, "tf32"), ("tile", "tf32", 4, "tf32")]
    for normalised in (True, False):
        k, v, beta, G = inputs(normalised)
        Tref = t_reference(k, beta, G)
        print(f"\n== keys {'l2-normalised' if normalised else 'raw N(0,1)'}; |T| max {Tref.abs().max().item():.3g}")
        for backward in (False, True):
            base = None
            for form, prec, warps, diag in variants:
                if backward and prec == "bf16":
                    continue  # the forward's option only: the recompute keeps tf32x3 (T is stored)
                try:
                    fn, Ai, w, u = launch(form, prec, warps, backward, k, v, beta, G, diag)
                except Exception as exc:  # a candidate that fails to compile or launch is a result
                    print(f"{'bwd' if backward else 'fwd'} {form:6} {prec:6} {warps}w diag {diag}: FAILED {type(exc).__name__}: {str(exc)[:150]}")
                    continue
                ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") if dev == "cuda" else float("nan")
                acc = ""
                if backward:
                    Tk = Ai[: 64 * len(Tref), 0].reshape(len(Tref), 64, 64)
                    acc += f" T vs fp64 {rel(Tk, Tref):.2e}"
                if base is None:
                    base = (w, u)
                else:
                    acc += f" W vs blocks {rel(w, base[0]):.2e} U vs blocks {rel(u, base[1]):.2e}"
                print(f"{'bwd' if backward else 'fwd'} {form:6} {prec:6} {warps}w diag {diag}: {ms:.3f} ms{acc}", flush=True)


# stage 6: the output kernel's forms, on the forward's own intermediates
if "output" in SECTIONS or "states" in SECTIONS:  # the forward's intermediates, for both
    q = torch.randn(Ntok, H, K, device=dev, dtype=torch.bfloat16)
    k, v, beta, _ = inputs(True)
    g = torch.nn.functional.logsigmoid(torch.randn(Ntok, H, device=dev))
    tk.SOLVE_FORM = "blocks"
    q_raw, kn, G, _Ai, _w, _u, h, vn, _ht = tk._recompute(q, k, v, g, beta, None, False, plan, False, for_backward=False)
    tk.SOLVE_FORM = DEFAULTS[0]
    scale = K ** -0.5
if "output" in SECTIONS:
    print("\n== output (stage 6), l2-normalised keys, q normalised in the kernel")
    DT, DA = tk._dot_types(torch.bfloat16)
    base = None
    for o_cfg in tk.OUTPUT_OPTIONS:
        cfg = dict(o_cfg)
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
        o = torch.empty(Ntok, H, V, device=dev, dtype=torch.bfloat16)
        n_items = plan.NC * triton.cdiv(V, cfg["BV"])
        progs = max(1, min(n_items, cfg["PER_SM"] * tk._sm_count(o.device) // H)) if cfg["PER_SM"] else n_items

        def run(o=o, cfg=cfg, warps=warps, stages=stages, progs=progs):
            tk._output_kernel.fn[(progs, H)](q_raw, kn, G, h, vn, o, plan.chunks, H, plan.NC, scale, tk.L2NORM_EPS,
                                             K=K, V=V, BK=BK, BT=64, DT=DT, DA=DA, L2NORM_Q=True, num_warps=warps,
                                             num_stages=stages, **cfg)
        try:
            run()
        except Exception as exc:
            print(f"triton {o_cfg}: FAILED {type(exc).__name__}: {str(exc)[:150]}")
            continue
        ms = triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median") if dev == "cuda" else float("nan")
        base = o if base is None else base
        print(f"triton {o_cfg}: {ms:.3f} ms, vs the first {rel(o, base):.2e}", flush=True)
    if dev == "cuda":
        from tileport.ops.gdn import gluon_kernels as gk

        for form in ("one-shot", "persistent"):
            gk.OUTPUT_FORM = form
            try:
                fn = lambda: gk.chunk_output_gluon(q_raw, kn, G, h, vn, scale, plan, torch.bfloat16, True)  # noqa: E731
                o = fn()
                ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
                print(f"gluon {form}: {ms:.3f} ms, vs triton's first {rel(o, base):.2e}", flush=True)
            except Exception as exc:
                print(f"gluon {form}: FAILED {type(exc).__name__}: {str(exc)[:150]}")
        gk.OUTPUT_FORM = "one-shot"


# stages 5 + 6: split against fused, autotuned as the forward runs them
if "states" in SECTIONS:
    print("\n== states + output (stages 5 and 6): split vs fused")
    _Ai, w, u = tk.chunk_solve_wu(kn, v, beta, G, plan, compact=True)


    def split():
        h_, vn_, _ = tk.chunk_states(kn, w, u, G, None, plan, False)
        return tk.chunk_output(q_raw, kn, G, h_, vn_, scale, plan, torch.bfloat16, l2norm_q=True)


    def fused():
        return tk.chunk_states(kn, w, u, G, None, plan, False, q=q_raw, scale=scale, out_dtype=torch.bfloat16,
                               l2norm_q=True)[0]


    def gluon_fused(bv, warps, gates="staged", ring=2):
        from tileport.ops.gdn import gluon_kernels as gk

        def run():
            launch = (gk.RECURRENCE_BV, gk.RECURRENCE_WARPS, gk.RECURRENCE_GATES, gk.RECURRENCE_RING)
            gk.RECURRENCE_BV, gk.RECURRENCE_WARPS, gk.RECURRENCE_GATES, gk.RECURRENCE_RING = bv, warps, gates, ring
            try:
                return gk.chunk_states_output_gluon(q_raw, kn, w, u, G, None, plan, False, scale, torch.bfloat16,
                                                    True)[0]
            finally:
                gk.RECURRENCE_BV, gk.RECURRENCE_WARPS, gk.RECURRENCE_GATES, gk.RECURRENCE_RING = launch
        return run


    o_split = split()
    for name, fn in (("split", split), ("fused", fused), ("gluon fused BV64 4w", gluon_fused(64, 4)),
                     ("gluon fused BV128 8w", gluon_fused(128, 8)),
                     ("gluon fused BV64 4w one buffer set (2 CTAs/SM)", gluon_fused(64, 4, ring=1))):
        if name.startswith("gluon") and dev != "cuda":
            continue  # Gluon kernels don't run under the interpreter
        try:
            o = fn()
            ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") if dev == "cuda" else float("nan")
            print(f"states+output {name}: {ms:.3f} ms, vs split {rel(o, o_split):.2e}", flush=True)
        except Exception as exc:  # report and go on: a new kernel's failure says nothing about the others
            print(f"states+output {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)


# the whole forward in each form of stages 5+6 (STATES_FORM "auto" picks fused at S1, split at
# B=1 T=32768) and each precision of stage 3 for normalised keys (NORMALISED_KEYS_PREC: tf32x3,
# tf32, bf16 the default since b9a387e), at S1 and at B=1 T=32768
if "forward" in SECTIONS:
    print("\n== whole forward (SOLVE_FORM tile): STATES_FORM, NORMALISED_KEYS_PREC, L2NORM_K_FORM")
    tk.SOLVE_FORM = "tile"
    for b_, t_ in ((B, T), (1, B * T)):
        qf = torch.randn(b_, t_, H, K, device=dev, dtype=torch.bfloat16)
        kf = torch.randn(b_, t_, H, K, device=dev, dtype=torch.bfloat16)
        vf = torch.randn(b_, t_, H, V, device=dev, dtype=torch.bfloat16)
        gf = torch.nn.functional.logsigmoid(torch.randn(b_, t_, H, device=dev))
        bf_ = torch.sigmoid(torch.randn(b_, t_, H, device=dev)).to(torch.bfloat16)
        base = None
        for states, prec, l2form in (("split", "tf32x3", "stage-1"), ("fused", "tf32x3", "stage-1"),
                                     ("fused", "tf32", "stage-1"), ("fused", "bf16", "stage-1"),
                                     ("split", "tf32", "stage-1"), ("split", "bf16", "stage-1"),
                                     ("fused", "bf16", "stage-3")):  # log row 19
            # (L2NORM_K_FORM "in-kernel" measured slower at 667cd8c: 1.224 vs 1.181 ms; no longer timed)
            tk.STATES_FORM, tk.NORMALISED_KEYS_PREC, tk.L2NORM_K_FORM = states, prec, l2form

            def fwd():
                return tk.gdn_forward_triton(qf, kf, vf, gf, bf_, K ** -0.5, None, False, True, None)[0]

            o = fwd()
            base = o if base is None else base
            ms = triton.testing.do_bench(fwd, warmup=10, rep=60, return_mode="median") if dev == "cuda" else float("nan")
            print(f"forward B={b_} T={t_} states {states} prec={prec:6} l2norm k {l2form:9}: {ms:.3f} ms, "
                  f"vs the first {rel(o, base):.2e}", flush=True)
        # stage 3 in two kernels (WU_FORM "split", log row 18) with the default 5+6 form, at tf32 and bf16 (row 16)
        tk.STATES_FORM, tk.NORMALISED_KEYS_PREC, tk.L2NORM_K_FORM = DEFAULTS[1:4]
        for wu_form, prec in (("fused", "tf32"), ("split", "tf32"), ("fused", "bf16"), ("split", "bf16")):
            tk.WU_FORM, tk.NORMALISED_KEYS_PREC = wu_form, prec
            tk.L2NORM_K_FORM, tk.CUMSUM_FORM = "stage-1", "stage-2"  # the split form takes stages 1 and 2's outputs
            o = fwd()
            ms = triton.testing.do_bench(fwd, warmup=10, rep=60, return_mode="median") if dev == "cuda" else float("nan")
            print(f"forward B={b_} T={t_} keys from stage 1, G from stage 2, WU_FORM {wu_form} prec={prec:6}: {ms:.3f} ms, "
                  f"vs the first {rel(o, base):.2e}", flush=True)
        tk.WU_FORM, tk.NORMALISED_KEYS_PREC, tk.CUMSUM_FORM = DEFAULTS[5], DEFAULTS[2], DEFAULTS[6]
        # the defaults with G formed in stage 3 (log row 20) and T by the factored chain (row 21)
        tk.STATES_FORM, tk.NORMALISED_KEYS_PREC, tk.L2NORM_K_FORM = DEFAULTS[1:4]
        # (G in stage 3 only where the states are fused: at S1, not B=1 T=32768 under "auto")
        forms = ((("stage-2", "horner"), ("stage-3", "horner"), ("stage-2", "factored"), ("stage-3", "factored"))
                 if tk.states_form(b_ * H) == "fused" else (("stage-2", "horner"), ("stage-2", "factored")))
        for cumsum, chain in forms:
            tk.CUMSUM_FORM, tk.T_CHAIN = cumsum, chain
            o = fwd()
            ms = triton.testing.do_bench(fwd, warmup=10, rep=60, return_mode="median") if dev == "cuda" else float("nan")
            print(f"forward B={b_} T={t_} defaults, CUMSUM_FORM {cumsum} T_CHAIN {chain:8}: {ms:.3f} ms, "
                  f"vs the first {rel(o, base):.2e}", flush=True)
        tk.CUMSUM_FORM, tk.T_CHAIN = DEFAULTS[6:8]
    tk.SOLVE_FORM, tk.STATES_FORM, tk.NORMALISED_KEYS_PREC, tk.L2NORM_K_FORM = DEFAULTS[:4]


# the whole forward of the two backends, same inputs, at S1 and B=1 T=32768: triton (its defaults)
# against gluon in each FORWARD_FORM and fused launch shape (RECURRENCE_BV, RECURRENCE_WARPS)
if "gluon" in SECTIONS and dev == "cuda":
    from tileport.ops.gdn import gluon_kernels as gk

    print("\n== whole forward: triton against gluon (FORWARD_FORM, fused launch shape)")
    gluon_defaults = (gk.FORWARD_FORM, gk.RECURRENCE_BV, gk.RECURRENCE_WARPS, gk.RECURRENCE_GATES, gk.RECURRENCE_RING,
                      gk.RECURRENCE_O_STORE)
    for b_, t_ in ((B, T), (1, B * T)):
        xs = (torch.randn(b_, t_, H, K, device=dev, dtype=torch.bfloat16),
              torch.randn(b_, t_, H, K, device=dev, dtype=torch.bfloat16),
              torch.randn(b_, t_, H, V, device=dev, dtype=torch.bfloat16),
              torch.nn.functional.logsigmoid(torch.randn(b_, t_, H, device=dev)),
              torch.sigmoid(torch.randn(b_, t_, H, device=dev)).to(torch.bfloat16))
        base = tk.gdn_forward_triton(*xs, K ** -0.5, None, False, True, None)[0]
        ms = triton.testing.do_bench(lambda: tk.gdn_forward_triton(*xs, K ** -0.5, None, False, True, None),
                                     warmup=10, rep=60, return_mode="median")
        print(f"forward B={b_} T={t_} triton: {ms:.3f} ms", flush=True)
        forms = (("split", 64, 4, "late", 2, "masked"), ("fused", 128, 8, "staged", 2, "masked"),
                 ("fused", 128, 8, "staged", 2, "tma"), ("fused", 64, 4, "staged", 2, "masked"),
                 ("fused", 64, 4, "staged", 1, "masked"), ("fused", 64, 4, "late", 1, "masked"),
                 ("fused", 64, 4, "staged", 1, "tma"))
        for form, bv, warps, gates, ring, ostore in forms if b_ > 1 else forms[:1]:
            gk.FORWARD_FORM, gk.RECURRENCE_BV, gk.RECURRENCE_WARPS, gk.RECURRENCE_GATES = form, bv, warps, gates
            gk.RECURRENCE_RING, gk.RECURRENCE_O_STORE = ring, ostore
            try:
                o = gk.gdn_forward_gluon(*xs, K ** -0.5, None, False, True, None)[0]
                ms = triton.testing.do_bench(lambda: gk.gdn_forward_gluon(*xs, K ** -0.5, None, False, True, None),
                                             warmup=10, rep=60, return_mode="median")
                print(f"forward B={b_} T={t_} gluon {form} BV{bv} {warps}w gates {gates} ring {ring} o {ostore}: {ms:.3f} ms, "
                      f"vs triton {rel(o, base):.2e}",
                      flush=True)
            except Exception as exc:
                print(f"forward B={b_} T={t_} gluon {form} BV{bv} {warps}w gates {gates} ring {ring} o {ostore}: FAILED {type(exc).__name__}: "
                      f"{str(exc)[:200]}", flush=True)
    (gk.FORWARD_FORM, gk.RECURRENCE_BV, gk.RECURRENCE_WARPS, gk.RECURRENCE_GATES, gk.RECURRENCE_RING,
     gk.RECURRENCE_O_STORE) = gluon_defaults


# the backward's products (BACKWARD_PRODUCTS): "bf16" (rounded operands, the form the bench timed
# at f7de67f: 8.14 ms at S1; dg and dbeta over their bound on ~1 in 130 draws), "bf16x3" (three
# bf16 products of fp32 operands: 15.3 ms at 667cd8c) and "tf32" (one tf32 product of fp32
# operands), the whole backward of the bench's inputs, once each, same inputs
if "backward" in SECTIONS:
    print("\n== whole backward: BACKWARD_PRODUCTS")
    qf, kf, vf, gf, bf_, do = backward_inputs(B, T)
    grads = {}
    block = tk.WY_BWD_KEY_BLOCK
    # (products, wy_bwd's block of key columns, the recompute's stage-3 precision and diagonal
    # inverses' precision, dqkwg's block of key columns, dqkwg's form). Measured before and no
    # longer timed here: bf16x3 products (14.57 ms at ed4ca69), wy_bwd in one 128-column block
    # (11.73), the recompute's stage 3 at tf32x3 (11.27), dqkwg in 32-column blocks (11.64).
    rdefault, qdefault, ddefault = tk.RECOMPUTE_NORMALISED_KEYS_PREC, tk.DQKWG_KEY_BLOCK, tk.RECOMPUTE_NORMALISED_KEYS_DIAG_PREC
    fdefault, wdefault = tk.DQKWG_FORM, tk.WY_BWD_FORM
    other_diag = {"ieee": "tf32", "tf32": "ieee"}[ddefault]
    other_form = {"one": "split", "split": "one"}[fdefault]
    other_wy = {"one": "split", "split": "one"}[wdefault]
    for products, wy_block, rprec, qblock, rdiag, dform, wform in (
            ("tf32", block, rdefault, qdefault, ddefault, fdefault, wdefault),
            ("bf16", block, rdefault, qdefault, ddefault, fdefault, wdefault),
            ("tf32", block, rdefault, qdefault, other_diag, fdefault, wdefault),  # row 28
            ("tf32", block, rdefault, qdefault, ddefault, other_form, wdefault),  # DQKWG_FORM, row 29
            ("tf32", block, rdefault, qdefault, ddefault, fdefault, other_wy),  # WY_BWD_FORM, row 30
            ("tf32", block, rdefault, qdefault, other_diag, other_form, other_wy)):  # rows 28-30 together
        tk.BACKWARD_PRODUCTS, tk.WY_BWD_KEY_BLOCK, tk.RECOMPUTE_NORMALISED_KEYS_PREC = products, wy_block, rprec
        tk.DQKWG_KEY_BLOCK, tk.RECOMPUTE_NORMALISED_KEYS_DIAG_PREC, tk.DQKWG_FORM = qblock, rdiag, dform
        tk.WY_BWD_FORM = wform
        name = (f"{products}, wy_bwd {wform} BKW={min(wy_block, BK)}, recompute {rprec} diag {rdiag}, "
                f"dqkwg {dform} BKS={qblock}")

        def bwd():
            return tk.gdn_backward_triton(do, None, qf, kf, vf, gf, bf_, K ** -0.5, None, True, None)

        grads[name] = bwd()
        ms = triton.testing.do_bench(bwd, warmup=5, rep=40, return_mode="median") if dev == "cuda" else float("nan")
        first = next(iter(grads))
        diff = "" if name == first else f", vs {first}: " + " ".join(
            f"{n} {rel(a, b):.1e}" for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), grads[name], grads[first]))
        print(f"backward S1 products={name:80}: {ms:.3f} ms{diff}", flush=True)
    tk.BACKWARD_PRODUCTS, tk.WY_BWD_KEY_BLOCK, tk.RECOMPUTE_NORMALISED_KEYS_PREC = DEFAULTS[4], block, rdefault
    tk.DQKWG_KEY_BLOCK, tk.RECOMPUTE_NORMALISED_KEYS_DIAG_PREC, tk.DQKWG_FORM = qdefault, ddefault, fdefault
    tk.WY_BWD_FORM = wdefault


# the backward's recurrences (the recompute's stage 5 and stage 8) on Triton's `_states_kernel` /
# `_dstates_kernel` and on the Gluon `_tf32_recurrence_kernel` in each launch shape, on the backward's own operands (fp32 q, k, W from the
# recompute, tf32 products), dense at S1 with dht and d initial_state, and varlen with a ragged
# tail; then the whole backward of each backend (the gluon one runs the Gluon stage 8)
if "dstates" in SECTIONS and dev == "cuda":
    from tileport.ops.gdn import gluon_kernels as gk

    print("\n== the backward's recurrences, the recompute's stage 5 (states) and stage 8 (dstates): Triton against "
          "Gluon (TF32_RECURRENCE_BV, TF32_RECURRENCE_WARPS), then the whole backward")
    dstates_defaults = (gk.TF32_RECURRENCE_BV, gk.TF32_RECURRENCE_WARPS)
    for label, cu in (("S1", None), ("varlen", [0, 1, 700, 700, 4100, 9000])):
        ntok = B * T if cu is None else cu[-1]
        shape = (B, T) if cu is None else (1, ntok)
        qf, kf, vf, gf, bf_, do = backward_inputs(*shape)
        cu_t = torch.tensor(cu, device=dev, dtype=torch.int32) if cu is not None else None
        plan_ = tk.make_plan(shape[0], shape[1], cu_t, dev)
        nseq = plan_.N
        h0 = torch.randn(nseq, H, K, V, device=dev)
        dht = torch.randn(nseq, H, K, V, device=dev)
        flat = [tk._flatten(x) for x in (qf, kf, vf, gf, bf_)]
        dof = tk._flatten(do)
        qn, kn, G, Ai, w, u, h, vn, _ = tk._recompute(*flat, h0, True, plan_, False, for_backward=True)
        def recurrence_ab(stage, triton_fn, gluon_fn, names):
            """Time Triton's form of a recurrence stage and the Gluon kernel in each launch shape on
            the same operands, and compare their outputs."""
            ref = triton_fn()
            ms = triton.testing.do_bench(triton_fn, warmup=5, rep=40, return_mode="median")
            print(f"{stage} {label} triton: {ms:.3f} ms", flush=True)
            for bv, warps in ((128, 8), (64, 4)):
                gk.TF32_RECURRENCE_BV, gk.TF32_RECURRENCE_WARPS = bv, warps
                try:
                    got = gluon_fn()
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(gluon_fn, warmup=5, rep=40, return_mode="median")
                    print(f"{stage} {label} gluon BV{bv} {warps}w: {ms:.3f} ms, vs triton: " +
                          " ".join(f"{n} {rel(a, b):.2e}" for n, a, b in zip(names, got, ref)), flush=True)
                except Exception as exc:
                    print(f"{stage} {label} gluon BV{bv} {warps}w: FAILED {type(exc).__name__}: {str(exc)[:300]}",
                          flush=True)
            gk.TF32_RECURRENCE_BV, gk.TF32_RECURRENCE_WARPS = dstates_defaults

        sargs = (kn, w, u, G, h0, plan_, True)
        recurrence_ab("states", lambda: tk.chunk_states(*sargs, input_dtype=torch.bfloat16, for_backward=True),
                      lambda: gk.chunk_states_recompute_gluon(*sargs, input_dtype=torch.bfloat16), ("h", "vn", "ht"))
        dvl = tk.chunk_dv_local(qn, kn, G, dof, K ** -0.5, plan_, input_dtype=torch.bfloat16)
        args = (qn, kn, w, G, dof, dvl, dht, K ** -0.5, plan_, True)
        recurrence_ab("dstates", lambda: tk.chunk_dstates(*args, input_dtype=torch.bfloat16),
                      lambda: gk.chunk_dstates_gluon(*args, input_dtype=torch.bfloat16), ("dh", "dvn", "dh0"))
        grads = {}
        for name, fn in (("triton", tk.gdn_backward_triton), ("gluon", gk.gdn_backward_gluon)):
            def bwd(fn=fn):
                return fn(do, dht, qf, kf, vf, gf, bf_, K ** -0.5, h0, True, cu_t)

            grads[name] = bwd()
            ms = triton.testing.do_bench(bwd, warmup=5, rep=40, return_mode="median")
            diff = "" if name == "triton" else ", vs triton: " + " ".join(
                f"{n} {rel(a, b):.1e}" for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads[name],
                                                            grads["triton"]))
            print(f"backward {label} {name}: {ms:.3f} ms{diff}", flush=True)


# stage 9 at S1 on the backward's own operands: Triton's split form's two kernels timed apart
# (9a `_dqk_local_kernel`, 9b `_dqkwg_kernel` with DS_HERE False), then 9 with its state part on the
# Gluon `_dqkwg_state_kernel` (BACKWARD_DQKWG), its outputs against Triton's; then the whole
# backward of the gluon backend with each BACKWARD_DQKWG
if "dqkwg" in SECTIONS and dev == "cuda":
    from tileport.ops.gdn import gluon_kernels as gk

    print("\n== stage 9 (dqkwg): Triton's 9a and 9b apart, and 9b on Gluon (BACKWARD_DQKWG)")
    qf, kf, vf, gf, bf_, do, flat, dof, qn, kn, G, Ai, w, u, h, vn, dh, dvn = stage_operands()
    args = (qn, kn, G, h, dh, vn, dvn, dof, K ** -0.5, plan, torch.float32)
    dqkwg_default = tk.DQKWG_FORM
    tk.DQKWG_FORM = "split"
    ref = tk.chunk_dqkwg(*args, input_dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: tk.chunk_dqkwg(*args, input_dtype=torch.bfloat16), warmup=5, rep=40,
                                 return_mode="median")
    BKS, NK = tk._key_split(K)
    products = tk._products(torch.bfloat16, True, "dqkwg")
    scratch = [torch.empty_like(qn, dtype=torch.float32) for _ in range(5)]
    dGs = torch.empty(NK + 1, B * T, H, device=dev)
    t9a = triton.testing.do_bench(lambda: tk._dqk_local_kernel[(plan.NC, H)](
        qn, kn, G, vn, dof, scratch[0], scratch[1], dGs[NK], plan.chunks, H, K ** -0.5, K, V, BKS, BV, NV, tk.BT,
        *products, **tk._LAUNCH["dqkwg"]), warmup=5, rep=40, return_mode="median")
    t9b = triton.testing.do_bench(lambda: tk._dqkwg_kernel[(plan.NC * NK, H)](
        qn, kn, G, h, dh, vn, dvn, dof, scratch[0], scratch[1], scratch[2], scratch[3], scratch[4], dGs, plan.chunks, H,
        K ** -0.5, B * T * H, K, V, BKS, BV, NV, tk.BT, *products, False, **tk._LAUNCH["dqkwg"]), warmup=5, rep=40,
        return_mode="median")
    print(f"dqkwg S1 triton split: {ms:.3f} ms (9a {t9a:.3f}, 9b {t9b:.3f})", flush=True)
    dqkwg_switch, state_form = gk.BACKWARD_DQKWG, gk.DQKWG_STATE_FORM
    gk.BACKWARD_DQKWG = "gluon"
    for gk.DQKWG_STATE_FORM in gk.DQKWG_STATE_FORMS:
        stage_ab(f"dqkwg S1 gluon 9b {gk.DQKWG_STATE_FORM}", lambda: gk.chunk_dqkwg_gluon(*args, input_dtype=torch.bfloat16),
                 ref, ("dq", "dk", "dw", "dG"))
    gk.DQKWG_STATE_FORM = state_form
    tk.DQKWG_FORM = dqkwg_default
    gk.BACKWARD_DQKWG = dqkwg_switch
    whole_backward_ab("BACKWARD_DQKWG", [{gk: dict(BACKWARD_DQKWG=f)} for f in ("triton", "gluon")],
                      lambda st: st[gk]["BACKWARD_DQKWG"])


# stage 10 (wy_bwd) at S1 on the backward's own operands: Triton's `chunk_wy_bwd` (WY_BWD_FORM)
# against the Gluon `_wy_bwd_tf32_kernel` (BACKWARD_WY), outputs compared; then the whole backward
# of the gluon backend with each BACKWARD_WY
if "wy" in SECTIONS and dev == "cuda":
    from tileport.ops.gdn import gluon_kernels as gk

    print("\n== stage 10 (wy_bwd): Triton's against Gluon's (BACKWARD_WY)")
    qf, kf, vf, gf, bf_, do, flat, dof, qn, kn, G, Ai, w, u, h, vn, dh, dvn = stage_operands()
    _, dkp, dw, dGp = gk.chunk_dqkwg_gluon(qn, kn, G, h, dh, vn, dvn, dof, K ** -0.5, plan, torch.float32,
                                          input_dtype=torch.bfloat16)
    args = (kn, flat[2], flat[4], G, Ai, w, u, dw, dvn, dkp, dGp, plan, torch.float32, torch.bfloat16, torch.bfloat16,
            gf.dtype)
    ref = tk.chunk_wy_bwd(*args, input_dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: tk.chunk_wy_bwd(*args, input_dtype=torch.bfloat16), warmup=5, rep=40,
                                 return_mode="median")
    print(f"wy_bwd S1 triton {tk.WY_BWD_FORM}: {ms:.3f} ms", flush=True)
    wy_switch = gk.BACKWARD_WY
    gk.BACKWARD_WY = "gluon"
    tiles = gk.WY_TILES
    for gk.WY_TILES in gk._WY_TILE_FORMS:
        stage_ab(f"wy_bwd S1 gluon, WY_TILES {gk.WY_TILES}", lambda: gk.chunk_wy_bwd_gluon(*args, input_dtype=torch.bfloat16),
                 ref, ("dk", "dv", "dbeta", "dg"))
    gk.WY_TILES = tiles
    gk.BACKWARD_WY = wy_switch
    whole_backward_ab("BACKWARD_WY", [{gk: dict(BACKWARD_WY=f, WY_L2NORM_K=l2, WY_TILES=t)} for f, l2, t in
                                      (("triton", "apart", "whole"), ("gluon", "apart", "whole"),
                                       ("gluon", "fused", "whole"), ("gluon", "apart", "halves"))],
                      lambda st: f"{st[gk]['BACKWARD_WY']}, WY_L2NORM_K {st[gk]['WY_L2NORM_K']}, "
                                 f"WY_TILES {st[gk]['WY_TILES']}")


# stage 9a at S1 on the backward's own operands: stage 9 (9b on Gluon) with its chunk-local part on
# Triton's `_dqk_local_kernel` against the Gluon `_dqk_local_tf32_kernel` (DQK_LOCAL), outputs
# compared; then the whole backward of the gluon backend with each DQK_LOCAL
if "dqk" in SECTIONS and dev == "cuda":
    from tileport.ops.gdn import gluon_kernels as gk

    print("\n== stage 9a (dqk_local): Triton's against Gluon's (DQK_LOCAL)")
    qf, kf, vf, gf, bf_, do, flat, dof, qn, kn, G, Ai, w, u, h, vn, dh, dvn = stage_operands()
    args = (qn, kn, G, h, dh, vn, dvn, dof, K ** -0.5, plan, torch.float32)
    dqk_switch = gk.DQK_LOCAL
    ref = None
    for form in ("triton", "gluon"):
        gk.DQK_LOCAL = form
        got = stage_ab(f"dqkwg S1 (9b gluon {gk.DQKWG_STATE_FORM}) with 9a {form}",
                       lambda: gk.chunk_dqkwg_gluon(*args, input_dtype=torch.bfloat16), ref, ("dq", "dk", "dw", "dG"))
        ref = got if ref is None else ref
    gk.DQK_LOCAL = dqk_switch
    whole_backward_ab("DQK_LOCAL", [{gk: dict(DQK_LOCAL=f, DQK_LOCAL_AT=at)} for f, at in
                                    (("triton", "stage-9"), ("gluon", "stage-9"), ("gluon", "stage-7"))],
                      lambda st: f"{st[gk]['DQK_LOCAL']} at {st[gk]['DQK_LOCAL_AT']}")
