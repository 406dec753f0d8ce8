"""A/B of the KDA Triton backend's DIAGONAL_FORM (forward: stage 3 and the output kernel; backward:
dv_local and the gated products) on the H200, at
S1 (B=8, T=4096, H=16, K=V=128, bf16): "exact" (pairwise exponents in every diagonal sub-block) against
"factored" (reference-row factors where a sub-block's gates span at most SPAN_MAX) and, forward
only, "chunk" (whole-chunk factors where a chunk's gates allow; the output kernel's whole-chunk
launch on OUTPUT_CHUNK_WARPS 4 and 8, OUTPUT_CHUNK_BV 64 and 128), with logsigmoid(N(0, 1)) gates
(the bench's: the factored and whole-chunk branches everywhere) and with steep gates (every entry
at -20..-30: the exact branch everywhere, so the cost of the run-time checks); then the per-kernel
times of one forward in "factored" and in "chunk" (torch profiler). Compiling the forms takes most
of a run: give it ~300 s on the H200. "profile-backward": the per-kernel times of one backward in
the default forms (torch profiler; never taken before the thirteenth session). "gluon": the
forward on the gluon backend against Triton's, and its per-kernel times. "fused": the backward with
9b's and 10b's whole-chunk routes fused into 9 and 10 or not (BACKWARD_FUSED_PAIRS), and its kernels.
"gluon-backward": the gluon backend's backward (its state recurrences in Gluon) against Triton's.
"dv-local": the gluon backward with stage 7's whole chunks in 64 value columns or all (DV_LOCAL_WHOLE_BV).
"kept": the forward keeping G, T and the flags for its backward (KEEP_FORWARD_TILES) or not.
"wy": the gluon backward with stage 10's unflagged chunks on Triton's kernel or on the Gluon one
(gluon_kernels.BACKWARD_WY), from kept tiles as training runs it, and its kernels. "dqkwg": the
same for stage 9 (gluon_kernels.BACKWARD_DQKWG); "wy-split": stage 10 as one Gluon kernel or as
two (gluon_kernels.WY_FORM). "solve": the gluon forward with stage 3 on Triton's kernel or the
Gluon one (gluon_kernels.FORWARD_SOLVE). "recurrence": the gluon forward with stages 5 and 6 split or
fused in one Gluon kernel (gluon_kernels.FORWARD_RECURRENCE), its gates loaded at the chunk's top
or a chunk ahead (RECURRENCE_GATES). "vn-from-t": the fused forward from stage 3's W and U
("fused") or with stage 3 stopped at T and Vn formed from T in the fused kernel ("fused-t").
"keys-in-stage-3": the fused-t forward with k normalised by stage 1 or by stage 3
(triton_kernels.KEYS_NORMALISED_IN). "inference": the fused-t forward under no_grad (the bench's
"fwd"), T in fp32 or bf16 (triton_kernels.FORWARD_T_DTYPE), q normalised in place or in registers
(gluon_kernels.Q_NORM). "kept-states": the keeping forward storing every chunk's h and Vn for the
backward, which then skips stage 5's recompute (triton_kernels.KEEP_FORWARD_STATES), or not.
"flagged-worklist": the gluon backward from kept tiles and states with its flagged chunks' launches
on the flags' worklist (triton_kernels.BACKWARD_FLAGGED_WORKLIST) or on whole grids.
"normalised-qk": the backward's normalised q and k in fp32 or bf16 (triton_kernels.BACKWARD_NORMALISED_QK).
"u-from-t": the backward from kept states with U never formed (triton_kernels.BACKWARD_U_FROM_T) or formed.
"dv-local-raw-qk": stage 7's whole chunks from the raw q and k (triton_kernels.DV_LOCAL_RAW_QK) or the fp32 copies.
"pairs-tiles": stage 10's pairs kernel with its tiles by pointer loads or by TMA (gluon_kernels.PAIRS_TILES).
"dA-tiles": stage 10's dA kernel with its dVn and dW tiles by pointer loads or by TMA (gluon_kernels.DA_TILES).
"pairs-keys": stage 10's pairs kernel forming its gated keys from a row layout or the accumulator's (gluon_kernels.PAIRS_GATED_KEYS).
"dv-local-gluon": stage 7's unflagged chunks on Triton's kernel or the Gluon one (gluon_kernels.BACKWARD_DV_LOCAL).
"dqkwg-tiles": stage 9's Gluon kernel taking dO and its epilogue's tiles by pointer loads or by TMA (gluon_kernels.DQKWG_TILES).

    python3 scripts/kda_ab.py        (on the GPU; under TRITON_INTERPRET=1 a tiny untimed dry run)
    KDA_AB_SECTIONS=forward,profile,backward,profile-backward,gluon,fused,gluon-backward,dv-local,kept,wy,dqkwg,wy-split,solve,recurrence,vn-from-t,keys-in-stage-3,inference,kept-states,flagged-worklist,normalised-qk,u-from-t,dv-local-raw-qk,pairs-tiles,dA-tiles,pairs-keys,dv-local-gluon,dqkwg-tiles,kept-states-16bit,dstates-16bit,w-16bit (default: the first three)
    KDA_AB_ONLY="chunk 4w BV64,chunk whole" (only these and exact)
"""

import os

import torch
import triton.testing

from tileport.ops.kda import triton_kernels as kk

B, T, H, K, V, dev = 8, 4096, 16, 128, 128, "cuda"
if not torch.cuda.is_available():
    B, T, H, K, V, dev = 1, 130, 2, 32, 32, "cpu"
torch.manual_seed(0)
q, k = (torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16) for _ in range(2))
v = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
beta = torch.sigmoid(torch.randn(B, T, H, device=dev)).to(torch.bfloat16)
gates = {"logsigmoid": torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=dev)),
         "steep": -20.0 - 10.0 * torch.rand(B, T, H, K, device=dev)}
SECTIONS = os.environ.get("KDA_AB_SECTIONS", "forward,profile,backward").split(",")
# KDA_AB_ONLY="chunk 4w BV64,chunk whole",...: time only these forms (tags as printed, "whole" included),
# besides "exact", the error reference; compiling the forms already timed costs most of a call
ONLY = [f for f in os.environ.get("KDA_AB_ONLY", "").split(",") if f]


def wanted(tag: str) -> bool:
    return not ONLY or tag == "exact" or tag.strip() in ONLY
default_form, default_warps, default_bv = kk.DIAGONAL_FORM, kk.OUTPUT_CHUNK_WARPS, kk.OUTPUT_CHUNK_BV
default_whole, default_cumsum, default_sums = kk.BACKWARD_WHOLE_CHUNKS, kk.CUMSUM_FORM, kk.GATE_SUMS_16BIT


def set_extras(form: str) -> str:
    """The switches a form's "+" suffixes name ("cumsum2"/"cumsum3": CUMSUM_FORM "stage-2"/"stage-3",
    kda.md row 12; "g64"/"g32": GATE_SUMS_16BIT "fp64"/"fp32", row 13), the others at their defaults
    (since the fourteenth session stage 3 and fp32); returns the diagonal form."""
    extras = form.split("+")[1:]
    kk.CUMSUM_FORM = ("stage-3" if "cumsum3" in extras else "stage-2" if "cumsum2" in extras else default_cumsum)
    kk.GATE_SUMS_16BIT = "fp32" if "g32" in extras else "fp64" if "g64" in extras else default_sums
    return form.split("+")[0]


def kernel_table(fn, title: str, calls: int = 5, rows: int = 12) -> None:
    """The torch profiler's per-kernel CUDA times of `calls` calls of fn (after one untimed call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    print(f"\n== {title}: kernels over {calls} calls")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows), flush=True)


def timed_gradients(fn, base):
    """(gradients, ms, err): fn()'s gradients, its do_bench median (nan off the GPU), and the worst
    normwise distance of its five gradients from base's (from its own, 0, when base is None)."""
    grads = fn()
    ref = grads if base is None else base
    err = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
              for a, b in zip(grads[:5], ref[:5]))
    ms = triton.testing.do_bench(fn, warmup=3, rep=20, return_mode="median") if dev == "cuda" else float("nan")
    return grads, ms, err


def fwd(g):
    return kk.kda_forward_triton(q, k, v, g, beta, K ** -0.5, None, False, True, None)[0]


for name, g in gates.items() if "forward" in SECTIONS else ():
    base = None
    chunk_launches = ((4, 64), (8, 64), (8, 128), (4, 128)) if name == "logsigmoid" else ((4, 64),)
    # the default launch and the one before kda.md rows 12 and 13 ("+cumsum2+g64"), timed before the
    # launch variants, whose compiling ran the section out of time at 7e672c1
    forms = (("exact", 4, 64), ("factored", 4, 64), ("chunk", *chunk_launches[0]), ("chunk+cumsum2+g64", 4, 64),
             *(("chunk", w, b) for w, b in chunk_launches[1:]))
    for form, warps, bv in forms:
        tag = f"{form} {warps}w BV{bv}" if form.startswith("chunk") else form
        if not wanted(tag):
            continue
        kk.DIAGONAL_FORM, kk.OUTPUT_CHUNK_WARPS, kk.OUTPUT_CHUNK_BV = set_extras(form), warps, bv
        o = fwd(g).float()
        base = o if base is None else base
        err = ((o - base).norm() / base.norm().clamp_min(1e-30)).item()
        ms = (triton.testing.do_bench(lambda: fwd(g), warmup=5, rep=40, return_mode="median") if dev == "cuda"
              else float("nan"))
        print(f"kda forward gates={name:10} diagonal {tag:8}: {ms:.3f} ms, vs exact {err:.2e}", flush=True)
kk.DIAGONAL_FORM, kk.OUTPUT_CHUNK_WARPS, kk.OUTPUT_CHUNK_BV = default_form, default_warps, default_bv
set_extras("")

if "profile" in SECTIONS and dev == "cuda":
    for form in ("factored", "chunk"):
        kk.DIAGONAL_FORM = form
        kernel_table(lambda: fwd(gates["logsigmoid"]), f"kda forward, DIAGONAL_FORM {form} (logsigmoid gates)")
    kk.DIAGONAL_FORM = default_form

# the backward (Triton since the fifth session) in each form: its dv_local and gated products take
# the same DIAGONAL_FORM ("chunk": "factored" blocks, or with BACKWARD_WHOLE_CHUNKS the recompute's
# stage 3, 7, 9b and 10b in whole chunks); same inputs and upstream gradient for all
do = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
launch = kk._LAUNCH_BACKWARD
for name, g in gates.items() if "backward" in SECTIONS else ():
    base = None
    # the block kernels (7, 9b, 10b) on 4 warps (the default: 360 B of spills at K = 128) and on 8 (none)
    for form, whole, warps in (("exact", False, 4), ("factored", False, 4), ("chunk", False, 4), ("chunk", False, 8),
                               ("chunk", True, 4), ("chunk+cumsum2+g64", True, 4)):
        tag = f"{form}{' whole' if whole else ''}{' blocks 8w' if warps == 8 else ''}"
        if not wanted(tag):
            continue
        kk.DIAGONAL_FORM, kk.BACKWARD_WHOLE_CHUNKS = set_extras(form), whole
        kk._LAUNCH_BACKWARD = dict(launch, num_warps=warps)

        def bwd():
            return kk.kda_backward_triton(do, None, q, k, v, g, beta, K ** -0.5, None, True, None)

        grads, ms, err = timed_gradients(bwd, base)
        base = grads if base is None else base
        print(f"kda backward gates={name:10} diagonal {tag:24}: {ms:.3f} ms, worst gradient vs exact {err:.2e}",
              flush=True)
kk.DIAGONAL_FORM, kk.BACKWARD_WHOLE_CHUNKS, kk._LAUNCH_BACKWARD = default_form, default_whole, launch
set_extras("")

if "profile-backward" in SECTIONS and dev == "cuda":
    g = gates["logsigmoid"]
    kernel_table(lambda: kk.kda_backward_triton(do, None, q, k, v, g, beta, K ** -0.5, None, True, None),
                 f"kda backward, defaults (DIAGONAL_FORM {kk.DIAGONAL_FORM}, BACKWARD_WHOLE_CHUNKS "
                 f"{kk.BACKWARD_WHOLE_CHUNKS}; logsigmoid gates)", calls=3, rows=20)

# "gluon": the forward on the gluon backend (Triton's stages, the output's whole chunks on the
# Gluon kernel) against Triton's, same inputs, and the per-kernel times of one
if "gluon" in SECTIONS and dev == "cuda":
    from tileport.ops.kda import gluon_kernels as kg

    def gluon_fwd(g):
        return kg.kda_forward_gluon(q, k, v, g, beta, K ** -0.5, None, False, True, None)[0]

    for name, g in gates.items():
        base = fwd(g).float()
        for tag, f in (("triton", fwd), ("gluon", gluon_fwd)):
            o = f(g).float()
            err = ((o - base).norm() / base.norm().clamp_min(1e-30)).item()
            ms = triton.testing.do_bench(lambda: f(g), warmup=5, rep=40, return_mode="median")
            print(f"kda forward gates={name:10} {tag:18}: {ms:.3f} ms, vs triton {err:.2e}", flush=True)
    kernel_table(lambda: gluon_fwd(gates["logsigmoid"]), "kda forward, gluon (logsigmoid gates)", rows=8)

# "fused": the backward in the default forms with 9b's and 10b's whole-chunk routes as their own
# launches or fused into 9 and 10 (BACKWARD_FUSED_PAIRS, kda.md rows 15 and 16), same inputs; then
# the per-kernel times of the fused default
if "fused" in SECTIONS:
    default_pairs = kk.BACKWARD_FUSED_PAIRS
    do = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
    for name, g in gates.items():
        base = None
        for pairs in ((), ("10b",), ("9b",), ("9b", "10b")):
            if name == "steep" and pairs not in ((), ("9b", "10b")):
                continue  # every chunk flagged: the fused kernels' flag checks are all that differs
            kk.BACKWARD_FUSED_PAIRS = pairs

            def bwd():
                return kk.kda_backward_triton(do, None, q, k, v, g, beta, K ** -0.5, None, True, None)

            grads, ms, err = timed_gradients(bwd, base)
            base = grads if base is None else base
            tag = "+".join(pairs) or "unfused"
            print(f"kda backward gates={name:10} pairs fused {tag:8}: {ms:.3f} ms, worst gradient vs unfused {err:.2e}",
                  flush=True)
    kk.BACKWARD_FUSED_PAIRS = default_pairs
    if dev == "cuda":
        kernel_table(lambda: kk.kda_backward_triton(do, None, q, k, v, gates["logsigmoid"], beta, K ** -0.5, None,
                                                    True, None),
                     f"kda backward, pairs fused {'+'.join(default_pairs) or 'none'} (logsigmoid gates)", calls=3,
                     rows=16)
        # what the autotuner picked for the backward's tuned kernels (GDN's, PER_CHANNEL) on these
        # inputs, and what each candidate took (its do_bench: median, p20, p80 in ms)
        from tileport.ops.gdn import triton_kernels as tk

        for name in ("_solve_wu_tile_kernel", "_states_kernel", "_dstates_kernel"):
            kern = getattr(tk, name)
            for cfg, t in (kern.configs_timings or {}).items():
                print(f"{name} {cfg}: {[round(x, 4) for x in t]}")
            for key, cfg in kern.cache.items():
                print(f"{name} picked: {cfg} (key {key})")

# "gluon-backward": the gluon backend's backward (Triton's stages, the two state recurrences on
# GDN's Gluon tf32 kernel, PER_CHANNEL; kda.md row 17) against Triton's, same inputs, and its kernels
if "gluon-backward" in SECTIONS and dev == "cuda":
    from tileport.ops.kda import gluon_kernels as kg

    do = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
    for name, g in gates.items():
        args = (do, None, q, k, v, g, beta, K ** -0.5, None, True, None)
        base = kk.kda_backward_triton(*args)
        for tag, fn in (("triton", kk.kda_backward_triton), ("gluon", kg.kda_backward_gluon)):
            _, ms, err = timed_gradients(lambda: fn(*args), base)
            print(f"kda backward gates={name:10} {tag:8}: {ms:.3f} ms, worst gradient vs triton {err:.2e}", flush=True)
    kernel_table(lambda: kg.kda_backward_gluon(do, None, q, k, v, gates["logsigmoid"], beta, K ** -0.5, None, True,
                                               None), "kda backward, gluon (logsigmoid gates)", calls=3, rows=16)

# "dv-local": the gluon backend's backward with stage 7's whole chunks in blocks of 64 value columns
# or on one program per chunk (DV_LOCAL_WHOLE_BV, kda.md row 18), same inputs, and its kernels
if "dv-local" in SECTIONS and dev == "cuda":
    from tileport.ops.kda import gluon_kernels as kg

    do = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
    default_dv_bv = kk.DV_LOCAL_WHOLE_BV
    args = (do, None, q, k, v, gates["logsigmoid"], beta, K ** -0.5, None, True, None)
    base = None
    for bv in (64, 128):
        kk.DV_LOCAL_WHOLE_BV = bv
        grads, ms, err = timed_gradients(lambda: kg.kda_backward_gluon(*args), base)
        base = grads if base is None else base
        print(f"kda backward (gluon) gates=logsigmoid DV_LOCAL_WHOLE_BV {bv:3}: {ms:.3f} ms, worst gradient vs 64 "
              f"{err:.2e}", flush=True)
        kernel_table(lambda: kg.kda_backward_gluon(*args), f"kda backward (gluon), DV_LOCAL_WHOLE_BV {bv}", calls=3,
                     rows=10)
    kk.DV_LOCAL_WHOLE_BV = default_dv_bv

# "kept": the forward keeps G, T and the flags for its backward (KEEP_FORWARD_TILES, kda.md row 19)
# or its backward recomputes stage 3; on the gluon backend, same inputs: the forward with and
# without keeping, the backward from kept tiles against the recompute, and forward + backward
# through autograd (tileport.chunk_kda) with the switch on and off; then the backward's kernels
if "kept" in SECTIONS:
    import tileport
    from tileport.ops.kda import gluon_kernels as kg

    g = gates["logsigmoid"]
    do = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
    fargs = (q, k, v, g, beta, K ** -0.5, None, False, True, None)
    bargs = (do, None, q, k, v, g, beta, K ** -0.5, None, True, None)
    fwd_gluon = kg.kda_forward_gluon if dev == "cuda" else kk.kda_forward_triton
    bwd_gluon = kg.kda_backward_gluon if dev == "cuda" else kk.kda_backward_triton

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=3, rep=20, return_mode="median") if dev == "cuda" else float("nan")

    for keep in (False, True):
        print(f"kda forward (gluon) keep_for_backward={keep}: {bench(lambda: fwd_gluon(*fargs, keep_for_backward=keep)):.3f} ms",
              flush=True)
    _, _, kept = fwd_gluon(*fargs, keep_for_backward=True)
    base, ms, _ = timed_gradients(lambda: bwd_gluon(*bargs), None)
    print(f"kda backward (gluon) recompute stage 3: {ms:.3f} ms", flush=True)
    _, ms, err = timed_gradients(lambda: bwd_gluon(*bargs, kept=kept), base)
    print(f"kda backward (gluon) from kept tiles  : {ms:.3f} ms, worst gradient vs recompute {err:.2e}", flush=True)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]

    def fwdbwd():
        o, _ = tileport.chunk_kda(*leaves, use_qk_l2norm_in_kernel=True)
        return torch.autograd.grad(o, leaves, do)

    default_keep = kk.KEEP_FORWARD_TILES
    for keep in (False, True):
        kk.KEEP_FORWARD_TILES = keep
        print(f"kda forward+backward (chunk_kda, autograd) KEEP_FORWARD_TILES={keep}: {bench(fwdbwd):.3f} ms", flush=True)
    kk.KEEP_FORWARD_TILES = default_keep
    if dev == "cuda":
        kernel_table(lambda: bwd_gluon(*bargs, kept=kept), "kda backward (gluon) from kept tiles", calls=3, rows=14)

# "wy" / "dqkwg": stage 10's (9's) unflagged chunks on Triton's kernel (PAIRS) or the Gluon one
# (BACKWARD_WY, kda.md row 20; BACKWARD_DQKWG, row 21), the gluon backward from kept tiles, same
# inputs, with both gate kinds; then its kernels
for section, switch, choices in (("wy", "BACKWARD_WY", ("triton", "gluon")), ("dqkwg", "BACKWARD_DQKWG", ("triton", "gluon")),
                                 ("wy-split", "WY_FORM", ("one-kernel", "split"))):
    if section not in SECTIONS or dev != "cuda":
        continue
    from tileport.ops.kda import gluon_kernels as kg

    do = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
    default_choice = getattr(kg, switch)
    default_u_free = kk.BACKWARD_U_FROM_T
    if section == "wy-split":
        # the one-kernel form reads U: with U never formed (BACKWARD_U_FROM_T) its rule hands the
        # chunks to Triton's kernel, and this section would time that instead; both forms with U
        kk.BACKWARD_U_FROM_T = False
    for name, g in gates.items():
        fargs = (q, k, v, g, beta, K ** -0.5, None, False, True, None)
        _, _, kept = kg.kda_forward_gluon(*fargs, keep_for_backward=True)
        bargs = (do, None, q, k, v, g, beta, K ** -0.5, None, True, None)
        base = None
        for choice in choices:
            setattr(kg, switch, choice)
            grads, ms, err = timed_gradients(lambda: kg.kda_backward_gluon(*bargs, kept=kept), base)
            base = grads if base is None else base
            print(f"kda backward (gluon, kept) gates={name:10} {switch} {choice!s:6}: {ms:.3f} ms, worst gradient vs "
                  f"{choices[0]} {err:.2e}", flush=True)
        if name == "logsigmoid":
            kernel_table(lambda: kg.kda_backward_gluon(*bargs, kept=kept),
                         f"kda backward (gluon, kept), {switch} {choices[-1]}", calls=3, rows=14)
        setattr(kg, switch, default_choice)
    kk.BACKWARD_U_FROM_T = default_u_free

def forward_ab(section: str, forms: dict, kept_name: str, final_state: bool, table_every_form: bool,
               keep: bool = True) -> None:
    """The gluon backend's forward, keeping its tiles as training runs it (keep; else as inference
    runs it, under no_grad, as the bench's "fwd" rows), in each of `forms`
    ({label: {switch of gluon_kernels: value}}), same inputs, both gate kinds: do_bench median,
    o's and the kept item's distance from the first form's (kept_name: "T", the kept tiles' T, or
    "final state" with final_state); the per-kernel table of the last form (of every form with
    table_every_form) with logsigmoid gates. Switches are restored after."""
    from tileport.ops.kda import gluon_kernels as kg

    def owner(switch):  # "triton_kernels.NAME" names a switch of kda/triton_kernels.py, NAME one of gluon_kernels
        return (kk, switch.split(".", 1)[1]) if switch.startswith("triton_kernels.") else (kg, switch)

    names = {switch for form in forms.values() for switch in form}
    defaults = {switch: getattr(*owner(switch)) for switch in names}
    for name, g in gates.items():
        fargs = (q, k, v, g, beta, K ** -0.5, None, final_state, True, None)
        base = None
        for i, (label, form) in enumerate(forms.items()):
            for switch in names:
                setattr(*owner(switch), form.get(switch, defaults[switch]))
            def run():
                with torch.no_grad() if not keep else torch.enable_grad():
                    return kg.kda_forward_gluon(*fargs, keep_for_backward=keep)

            o, ht, *kept = run()
            other = ht if final_state else kept[0].T
            base = (o.float(), other) if base is None else base
            err_o = ((o.float() - base[0]).norm() / base[0].norm().clamp_min(1e-30)).item()
            err_x = ((other - base[1]).norm() / base[1].norm().clamp_min(1e-30)).item()
            same = torch.equal(o.float(), base[0]) and torch.equal(other, base[1])
            ms = triton.testing.do_bench(run, warmup=5, rep=40, return_mode="median")
            how = "keep" if keep else "no_grad"
            print(f"kda forward (gluon, {how}) gates={name:10} {section} {label:11}: {ms:.3f} ms, o vs "
                  f"{next(iter(forms))} {err_o:.2e}, {kept_name} {err_x:.2e}{' (bitwise)' if same else ''}", flush=True)
            if name == "logsigmoid" and (table_every_form or i == len(forms) - 1):
                kernel_table(run, f"kda forward (gluon, {how}), {section} {label}", rows=10)
    for switch, value in defaults.items():
        setattr(*owner(switch), value)


# "solve": stage 3 on Triton's tile kernel or on the Gluon one (gluon_kernels.FORWARD_SOLVE)
if "solve" in SECTIONS and dev == "cuda":
    forward_ab("FORWARD_SOLVE", {"triton": {"FORWARD_SOLVE": "triton"}, "gluon": {"FORWARD_SOLVE": "gluon"}}, "T",
               final_state=False, table_every_form=False)

# "recurrence": stages 5 and 6 split (Triton's states kernel, then the Gluon output kernel) or fused
# in one Gluon kernel (gluon_kernels.FORWARD_RECURRENCE), its gates loaded at the chunk's top or a
# chunk ahead (RECURRENCE_GATES), with a final state
if "recurrence" in SECTIONS and dev == "cuda":
    forward_ab("FORWARD_RECURRENCE", {"split": {"FORWARD_RECURRENCE": "split"},
                                      "fused/top": {"FORWARD_RECURRENCE": "fused", "RECURRENCE_GATES": "top"},
                                      "fused/ahead": {"FORWARD_RECURRENCE": "fused", "RECURRENCE_GATES": "ahead"}},
               "final state", final_state=True, table_every_form=True)

# "vn-from-t": the fused forward from W and U, or with stage 3 stopping at T and the fused kernel
# forming Vn = T diag(beta) (V - (e^G K) h) (gluon_kernels.FORWARD_RECURRENCE "fused-t")
if "vn-from-t" in SECTIONS and dev == "cuda":
    forward_ab("FORWARD_RECURRENCE", {"fused/ahead": {"FORWARD_RECURRENCE": "fused", "RECURRENCE_GATES": "ahead"},
                                      "fused-t/ahead": {"FORWARD_RECURRENCE": "fused-t", "RECURRENCE_GATES": "ahead"},
                                      "fused-t/top": {"FORWARD_RECURRENCE": "fused-t", "RECURRENCE_GATES": "top"}},
               "final state", final_state=True, table_every_form=True)

# "keys-in-stage-3": the fused-t forward with k normalised by stage 1 (l2norm_fwd) or by stage 3's
# tile kernel as it loads the keys (triton_kernels.KEYS_NORMALISED_IN)
if "keys-in-stage-3" in SECTIONS and dev == "cuda":
    forward_ab("KEYS_NORMALISED_IN", {"stage-1": {"triton_kernels.KEYS_NORMALISED_IN": "stage-1"},
                                      "stage-3": {"triton_kernels.KEYS_NORMALISED_IN": "stage-3"}},
               "final state", final_state=True, table_every_form=True)

# "inference": the fused-t forward as the bench's "fwd" rows run it (no_grad: T kept by no backward),
# with T stored by stage 3 in fp32 or bf16 (triton_kernels.FORWARD_T_DTYPE) and q normalised in its
# tile in place or in registers where it is read (gluon_kernels.Q_NORM)
if "inference" in SECTIONS and dev == "cuda":
    forward_ab("T, Q_NORM", {"t32/inplace": {"triton_kernels.FORWARD_T_DTYPE": "fp32", "Q_NORM": "in-place"},
                             "t16/inplace": {"triton_kernels.FORWARD_T_DTYPE": "input", "Q_NORM": "in-place"},
                             "t32/regs": {"triton_kernels.FORWARD_T_DTYPE": "fp32", "Q_NORM": "registers"},
                             "t16/regs": {"triton_kernels.FORWARD_T_DTYPE": "input", "Q_NORM": "registers"}},
               "final state", final_state=True, table_every_form=True, keep=False)

def backward_switch_ab(label: str, module, switch: str, values: tuple, check=None, tables=("logsigmoid",)) -> None:
    """A switch of the gluon backend's training path (`module.<switch>`) at each of values, same
    inputs, under each kind of gates: the keeping forward, the backward from what it kept (its
    gradients' worst normwise distance from the first value's), and forward + backward through
    autograd (tileport.chunk_kda); the backward's kernels under the gates named in tables.
    check(value, kept): an assertion on what the forward kept."""
    import tileport
    from tileport.ops.kda import gluon_kernels as kg

    default = getattr(module, switch)
    do = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
    for name, g in gates.items():
        fargs = (q, k, v, g, beta, K ** -0.5, None, False, True, None)
        bargs = (do, None, q, k, v, g, beta, K ** -0.5, None, True, None)
        base = None
        for value in values:
            setattr(module, switch, value)
            ms = triton.testing.do_bench(lambda: kg.kda_forward_gluon(*fargs, keep_for_backward=True), warmup=3,
                                         rep=20, return_mode="median")
            _, _, kept = kg.kda_forward_gluon(*fargs, keep_for_backward=True)
            if check is not None:
                check(value, kept)
            grads, bms, err = timed_gradients(lambda: kg.kda_backward_gluon(*bargs, kept=kept), base)
            base = grads if base is None else base
            leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]

            def fwdbwd():
                o, _ = tileport.chunk_kda(*leaves, use_qk_l2norm_in_kernel=True)
                return torch.autograd.grad(o, leaves, do)

            fbms = triton.testing.do_bench(fwdbwd, warmup=3, rep=20, return_mode="median")
            print(f"kda gluon gates={name:10} {switch}={value!s:5}: keeping forward {ms:.3f} ms, backward from kept "
                  f"{bms:.3f} ms (worst gradient vs {switch}={values[0]}'s {err:.2e}), forward+backward (chunk_kda) "
                  f"{fbms:.3f} ms", flush=True)
            if name in tables:
                kernel_table(lambda: kg.kda_backward_gluon(*bargs, kept=kept),
                             f"kda backward (gluon) from kept, gates {name}, {label} {switch}={value}", calls=3, rows=16)
            del kept
    setattr(module, switch, default)


# "kept-states": the keeping forward with every chunk's h and Vn stored by the fused kernel for the
# backward (triton_kernels.KEEP_FORWARD_STATES) or not (the backward recomputes stage 5)
if "kept-states" in SECTIONS and dev == "cuda":
    def states_kept(value, kept):
        assert (kept.h is not None) == value, "the switch decides whether h and Vn are kept"

    backward_switch_ab("kept-states", kk, "KEEP_FORWARD_STATES", (False, True), check=states_kept)

# "flagged-worklist": the backward's flagged chunks' launches (stages 7, 9, 9b, 10, 10b) on a
# persistent grid over the flags' worklist (triton_kernels.BACKWARD_FLAGGED_WORKLIST) or on whole
# grids whose unflagged programs return at once (the same sums: expect 0 between them); kernels
# under the logsigmoid gates (few flagged chunks) and the steep ones (every chunk flagged)
if "flagged-worklist" in SECTIONS and dev == "cuda":
    backward_switch_ab("flagged-worklist", kk, "BACKWARD_FLAGGED_WORKLIST", (False, True),
                       tables=("logsigmoid", "steep"))

# "normalised-qk": the backward's normalised q and k in fp32 or in the inputs' dtype
# (triton_kernels.BACKWARD_NORMALISED_QK "input", the default since a876bf4: the cut (2) of "The
# backward's bytes"), the gradients' distance between them beside the time; with stage 8 on
# Triton's kernel for bf16 keys, then on the Gluon one taking them (gdn gluon_kernels.DSTATES_16BIT_KEYS)
if "normalised-qk" in SECTIONS and dev == "cuda":
    from tileport.ops.gdn import gluon_kernels as gdn_gluon_keys

    default_16bit_keys = gdn_gluon_keys.DSTATES_16BIT_KEYS
    for on in (False, True):
        gdn_gluon_keys.DSTATES_16BIT_KEYS = on
        backward_switch_ab(f"normalised-qk, DSTATES_16BIT_KEYS={on}", kk, "BACKWARD_NORMALISED_QK", ("fp32", "input"))
    gdn_gluon_keys.DSTATES_16BIT_KEYS = default_16bit_keys

# "u-from-t": the backward from the kept states never forming U (triton_kernels.BACKWARD_U_FROM_T:
# stage 10 takes dXu U^T as (dXu (diag(beta) V)^T) T^T) or forming it, kda.md row 36
if "u-from-t" in SECTIONS and dev == "cuda":
    backward_switch_ab("u-from-t", kk, "BACKWARD_U_FROM_T", (False, True))

# "dv-local-raw-qk": stage 7's whole chunks from the raw bf16 q and k, normalised where loaded
# (triton_kernels.DV_LOCAL_RAW_QK), or from l2norm_fwd's fp32 copies, kda.md row 38
if "dv-local-raw-qk" in SECTIONS and dev == "cuda":
    backward_switch_ab("dv-local-raw-qk", kk, "DV_LOCAL_RAW_QK", (False, True))

# "pairs-tiles": stage 10's pairs kernel taking a block's G, dXw, dK', K and dG' tiles by pointer
# loads at the block's start ("loads") or by TMA, the next block's under this one's work
# (gluon_kernels.PAIRS_TILES "tma"), kda.md row 39
if "pairs-tiles" in SECTIONS and dev == "cuda":
    from tileport.ops.kda import gluon_kernels as kg_pairs

    backward_switch_ab("pairs-tiles", kg_pairs, "PAIRS_TILES", ("loads", "tma"))

# "dA-tiles": stage 10's dA kernel taking a block's dVn and dW tiles by pointer loads transposed into
# shared memory at the block's start ("loads") or by TMA into staging slots, the next block's under
# this one's work (gluon_kernels.DA_TILES "tma"), kda.md row 40
if "dA-tiles" in SECTIONS and dev == "cuda":
    from tileport.ops.kda import gluon_kernels as kg_da

    backward_switch_ab("dA-tiles", kg_da, "DA_TILES", ("loads", "tma"))

# "pairs-keys": stage 10's pairs kernel forming its transposed gated keys from K and G read again in a
# row layout ("rows") or from the accumulator layout's tiles it reads anyway, e^d and e^-d formed
# once (gluon_kernels.PAIRS_GATED_KEYS "accumulator"), kda.md row 42
if "pairs-keys" in SECTIONS and dev == "cuda":
    from tileport.ops.kda import gluon_kernels as kg_keys

    backward_switch_ab("pairs-keys", kg_keys, "PAIRS_GATED_KEYS", ("rows", "accumulator"))

# "dv-local-gluon": stage 7's unflagged chunks on Triton's whole-chunk launch or on the Gluon kernel
# (gluon_kernels.BACKWARD_DV_LOCAL "gluon": TMA and tf32 WGMMA), kda.md row 43
if "dv-local-gluon" in SECTIONS and dev == "cuda":
    from tileport.ops.kda import gluon_kernels as kg_dvl

    backward_switch_ab("dv-local-gluon", kg_dvl, "BACKWARD_DV_LOCAL", ("triton", "gluon"))

# "dqkwg-tiles": stage 9's Gluon kernel taking dO and its epilogue's G, q, k tiles by pointer loads
# ("loads") or all by TMA at the item's start into slots used only later (gluon_kernels.DQKWG_TILES
# "tma"), kda.md row 46
if "dqkwg-tiles" in SECTIONS and dev == "cuda":
    from tileport.ops.kda import gluon_kernels as kg_dqt

    backward_switch_ab("dqkwg-tiles", kg_dqt, "DQKWG_TILES", ("loads", "tma"))

# "kept-states-16bit": the forward's kept h and Vn in fp32 or in the inputs' bf16
# (triton_kernels.KEPT_STATES_DTYPE "bf16": half the bytes written by the fused forward and read by
# stage 9, which widens them; the gradients' distance from fp32 states beside the time), kda.md row 48
if "kept-states-16bit" in SECTIONS and dev == "cuda":
    def states_dtype(value, kept):
        want = torch.float32 if value == "fp32" else torch.bfloat16
        assert kept.h.dtype == kept.vn.dtype == want, (value, kept.h.dtype, kept.vn.dtype)

    backward_switch_ab("kept-states-16bit", kk, "KEPT_STATES_DTYPE", ("fp32", "bf16"), check=states_dtype)

# "dstates-16bit": stage 8's dh and dVn in fp32 or bf16 (triton_kernels.BACKWARD_DSTATES_DTYPE "bf16":
# half the bytes stage 8 writes and stages 9 and 10 read, widened where read), with the kept h and Vn
# in fp32 and then in bf16 (row 48 beside it: all four states in 16 bits, as FLA keeps them), kda.md row 49
if "dstates-16bit" in SECTIONS and dev == "cuda":
    default_kept = kk.KEPT_STATES_DTYPE
    for kept_dtype in ("fp32", "bf16"):
        kk.KEPT_STATES_DTYPE = kept_dtype
        backward_switch_ab(f"dstates-16bit, KEPT_STATES_DTYPE={kept_dtype}", kk, "BACKWARD_DSTATES_DTYPE",
                           ("fp32", "bf16"))
    kk.KEPT_STATES_DTYPE = default_kept

# "w-16bit": the backward's W (formed from the kept T) in fp32 or bf16 (triton_kernels.BACKWARD_W_DTYPE
# "bf16": 134 MB less written by wu_from_t and read by stage 8 and the dA kernel each, widened where
# read), then with every 16-bit switch of rows 48-50 on together, kda.md row 50
if "w-16bit" in SECTIONS and dev == "cuda":
    backward_switch_ab("w-16bit", kk, "BACKWARD_W_DTYPE", ("fp32", "bf16"))
    default_16 = (kk.KEPT_STATES_DTYPE, kk.BACKWARD_DSTATES_DTYPE)
    kk.KEPT_STATES_DTYPE, kk.BACKWARD_DSTATES_DTYPE = "bf16", "bf16"
    backward_switch_ab("w-16bit, 16-bit states", kk, "BACKWARD_W_DTYPE", ("fp32", "bf16"))
    kk.KEPT_STATES_DTYPE, kk.BACKWARD_DSTATES_DTYPE = default_16
