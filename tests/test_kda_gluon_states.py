"""KDA's forward stages 5 and 6 fused on one Gluon kernel (`gluon_kernels._kda_states_output_kernel`,
FORWARD_RECURRENCE "fused"): the state recurrence with h kept on the chip, the output of every
unflagged chunk formed there, the flagged chunks' h and Vn stored for Triton's block kernel
(`chunk_states_output_kda_gluon`); and its form "fused-t", where stage 3 stops at T and the kernel
forms Vn from T. On the GPU: the gluon backend's forward with the fused kernel against the same
forward with the split stages (Triton's states kernel, then the Gluon output kernel), route by
route, "fused-t" against "fused" likewise, and every form against the float64 reference through
the gate's cases. On the CPU: the switch, the rule, the launch checks and stage 3's T alone;
tests/test_gluon_compile.py compile-checks the kernel for sm_90a.
"""

from __future__ import annotations

import pytest
import test_kda_parity as parity  # a module import: pytest would collect imported test functions
import torch
from kda_stage_cases import LAYOUTS, normwise, rounded_as_kernels_round, route_rows
from standins import operand, spy_on_kernels
from test_kda_parity import _one_thread  # noqa: F401 (autouse fixture)

from tileport.testing import poisoned

@pytest.fixture
def fused(monkeypatch):
    """FORWARD_RECURRENCE "fused" (W and U read; the tests that want "fused-t", the default, set
    it), and the fused kernel's launches recorded (their grids)."""
    from tileport.ops.kda import gluon_kernels as gk

    return spy_on_kernels(monkeypatch, gk, ["_kda_states_output_kernel"], FORWARD_RECURRENCE="fused")[0]


def _inputs(layout: str, K: int, h0: bool, device: str):
    """bf16 inputs with l2-normalised keys, K = V, H = 2; LAYOUTS' steep tokens flag some chunks of
    head 0, the other chunks take logsigmoid(randn) gates (unflagged)."""
    cu, B, T, (lo, hi) = LAYOUTS[layout]
    q, k, v, g, beta, h0_t, cu_t = parity.make_inputs(B, T, 2, K, K, torch.bfloat16, cu, h0, True, "normal", "rand",
                                                      device)
    g[0, lo:hi, 0] = -20.0 - 10.0 * torch.rand(hi - lo, K, device=device)
    return q, k, v, g, beta, h0_t, cu_t


def _chunk_routes(inputs, device, solve):
    """(B, T, unflagged, flagged) for `_inputs`' draw: [Ntok, H] masks of the rows of the chunks
    stage 3 (solve: `chunk_solve_wu`) leaves whole and of those it flags; the draw must take both."""
    from tileport.ops.kda import triton_kernels as kk

    B, T, H = inputs[0].shape[:3]
    plan = kk.make_plan(B, T, inputs[6], inputs[0].device)
    flags = torch.empty((plan.NC, H), dtype=torch.int8, device=device)
    gf = kk._flatten(inputs[3])
    G = torch.empty(gf.shape, dtype=torch.float32, device=device)
    solve(kk.l2norm_fwd(kk._flatten(inputs[1])), kk._flatten(inputs[2]), kk._flatten(inputs[4]), G, plan, compact=True,
          keys_normalised=True, g=gf, span_flags=flags)
    assert (flags == 0).any() and (flags != 0).any(), f"the draw should flag some chunks and not others: {flags}"
    unflagged, flagged = (m.to(device) for m in route_rows(plan, flags))
    return B, T, unflagged, flagged


def _forward(form: str, inputs, K: int, final: bool, monkeypatch):
    from tileport.ops.kda import gluon_kernels as gk

    with monkeypatch.context() as m:
        m.setattr(gk, "FORWARD_RECURRENCE", form)
        with poisoned():
            return gk.kda_forward_gluon(*inputs[:5], K ** -0.5, inputs[5], final, True, inputs[6])


# (layout, K, h0, final, gates): every combination at RECURRENCE_GATES' default "ahead" (the next
# chunk's gates loaded at the end of this one, zero past the sequence); "top" with both states
ROUTE_CASES = ([(lay, K, h0, fin, "ahead") for lay in LAYOUTS for K in (64, 128) for h0 in (True, False)
                for fin in (True, False)]
               + [(lay, K, True, True, "top") for lay in LAYOUTS for K in (64, 128)])


@pytest.mark.parametrize("layout,K,h0,final,gates", ROUTE_CASES,
                         ids=[f"{lay}-K{K}-{'h0' if h0 else 'no-h0'}-{'final' if fin else 'no-final'}-{gates}"
                              for lay, K, h0, fin, gates in ROUTE_CASES])
def test_fused_matches_split_route_by_route(layout, K, h0, final, gates, device, seed, fused, monkeypatch):
    """o of the fused forward against the split forward's on the same inputs, on the rows of
    unflagged chunks (formed in the fused kernel) and of flagged ones (Triton's block kernel, from
    the h and Vn the fused kernel stored) apart, and the final state: bitwise equal. Outputs are
    NaN-poisoned (so are the fused kernel's h and Vn buffers, which only flagged chunks write): a
    row no route writes, or a flagged chunk read from an unwritten h, fails.
    Why bitwise: both forms round the same operands to bf16 at the same points (h, Vn, the scaled
    keys, Q e^d, Q e^(d + G_m), P) and multiply them on the same WGMMA shapes in the same k order
    (Triton's tl.dot in the states kernel lowers to them too); the H200 found them equal to the bit
    on every case here (first at bound 2^-8) and at S1 with both gate kinds (kda_ab "recurrence",
    docs/perf/kda.md row 25). A difference means the two forms' arithmetic diverged: find where
    before accepting a bound."""
    parity._backend_or_skip("gluon", device)
    from tileport.ops.kda import triton_kernels as kk

    from tileport.ops.kda import gluon_kernels as gk

    monkeypatch.setattr(gk, "RECURRENCE_GATES", gates)
    inputs = _inputs(layout, K, h0, device)
    o_split, ht_split = _forward("split", inputs, K, final, monkeypatch)
    assert fused.grids == [], "the split form launched the fused kernel"
    o, ht = _forward("fused", inputs, K, final, monkeypatch)
    H = 2
    N = inputs[0].shape[0] if inputs[6] is None else inputs[6].numel() - 1
    assert fused.grids == [(N * H, 1)], fused.grids

    where = f"[{layout} K={K} h0={h0} final={final} gates={gates} seed={seed}]"
    B, T, unflagged, flagged = _chunk_routes(inputs, device, kk.chunk_solve_wu)
    of, osf = o.reshape(B * T, H, -1), o_split.reshape(B * T, H, -1)
    for route, rows in (("unflagged", unflagged), ("flagged", flagged)):
        assert not of[rows].isnan().any(), f"o on {route} chunks {where}: not written"
        assert torch.equal(of[rows], osf[rows]), (f"o on {route} chunks {where}: {normwise(of[rows], osf[rows]):.2e} "
                                                  f"normwise from the split form's")
    assert (ht is None) == (not final) and (ht_split is None) == (not final)
    if final:
        assert torch.equal(ht, ht_split), f"final state {where}: {normwise(ht, ht_split):.2e} normwise from the split form's"


# "fused-t" against "fused": (layout, K, h0 and final, gates)
FROM_T_CASES = ([(lay, K, True, gates) for lay in LAYOUTS for K in (64, 128) for gates in ("ahead", "top")]
                + [(lay, 128, False, "ahead") for lay in LAYOUTS])
# Vn from T rounds other operands to bf16 than Vn from W and U (X = diag(beta)(V - (e^G K) h) once,
# against W, U and their difference): each form is a few bf16 steps (2^-9 relative) from the exact
# o; a structural error (a row's beta or a T row left out, a chunk's T from another) moves o by
# O(1). 2^-6 normwise lies between the two.
FROM_T_BOUND = 2.0 ** -6


@pytest.mark.parametrize("layout,K,states,gates", FROM_T_CASES,
                         ids=[f"{lay}-K{K}-{'states' if st else 'no-states'}-{gates}" for lay, K, st, gates in FROM_T_CASES])
def test_vn_from_t_matches_fused_route_by_route(layout, K, states, gates, device, seed, fused, monkeypatch):
    """o of the forward with stage 3 stopped at T and Vn formed from it in the fused kernel
    ("fused-t") against the "fused" form's on the same inputs, on the rows of unflagged chunks and
    of flagged ones apart (both written: outputs and the h and Vn buffers are NaN-poisoned), and
    the final state, within FROM_T_BOUND; and stage 3 ran without W and U (with_wu off)."""
    parity._backend_or_skip("gluon", device)
    from tileport.ops.kda import gluon_kernels as gk
    from tileport.ops.kda import triton_kernels as kk

    monkeypatch.setattr(gk, "RECURRENCE_GATES", gates)
    inputs = _inputs(layout, K, states, device)
    o_ref, ht_ref = _forward("fused", inputs, K, states, monkeypatch)
    solve_calls = []
    real_solve = kk.chunk_solve_wu

    def solve_spy(*args, **kwargs):
        solve_calls.append(kwargs.get("with_wu", True))
        return real_solve(*args, **kwargs)

    monkeypatch.setattr(kk, "chunk_solve_wu", solve_spy)
    o, ht = _forward("fused-t", inputs, K, states, monkeypatch)
    assert solve_calls == [False], f"stage 3 should run once, without W and U: with_wu per call {solve_calls}"
    H = 2
    N = inputs[0].shape[0] if inputs[6] is None else inputs[6].numel() - 1
    assert fused.grids == [(N * H, 1)] * 2, fused.grids

    where = f"[{layout} K={K} states={states} gates={gates} seed={seed}]"
    B, T, unflagged, flagged = _chunk_routes(inputs, device, real_solve)
    of, orf = o.reshape(B * T, H, -1), o_ref.reshape(B * T, H, -1)
    for route, rows in (("unflagged", unflagged), ("flagged", flagged)):
        assert not of[rows].isnan().any(), f"o on {route} chunks {where}: not written"
        err = normwise(of[rows], orf[rows])
        assert err <= FROM_T_BOUND, f"o on {route} chunks {where}: {err:.2e} normwise from the fused form's"
    assert (ht is None) == (not states)
    if states:
        err = normwise(ht, ht_ref)
        assert err <= FROM_T_BOUND, f"final state {where}: {err:.2e} normwise from the fused form's"


@pytest.mark.parametrize("layout,K", [(lay, K) for lay in LAYOUTS for K in (64, 128)])
def test_queries_normalised_in_the_kernel_match_stage_1(layout, K, device, seed):
    """The fused kernel with raw queries normalised in it (l2norm_q, "fused-t"'s default) against
    the same kernel on stage 1's normalised queries, on the same stage-3 outputs: o (both routes:
    the flagged chunks' block kernel reads the rows the kernel stored) and the final state bitwise
    equal, as both round q * rsqrt(sum(q^2) + eps) to bf16 once."""
    parity._backend_or_skip("gluon", device)
    from tileport.ops.kda import gluon_kernels as gk
    from tileport.ops.kda import triton_kernels as kk

    q, k, v, g, beta, h0, cu = _inputs(layout, K, True, device)
    B, T, H = q.shape[0], q.shape[1], 2
    plan = kk.make_plan(B, T, cu, q.device)
    flags = torch.empty((plan.NC, H), dtype=torch.int8, device=device)
    gf, vf, bf = (kk._flatten(x) for x in (g, v, beta))
    qf, kn = kk._flatten(q), kk.l2norm_fwd(kk._flatten(k))
    G = torch.empty(gf.shape, dtype=torch.float32, device=device)
    Tm, _, _ = kk.chunk_solve_wu(kn, vf, bf, G, plan, store_T=True, compact=True, keys_normalised=True, g=gf,
                                 span_flags=flags, with_wu=False)
    assert (flags == 0).any() and (flags != 0).any(), f"the draw should flag some chunks and not others: {flags}"
    outs = []
    for l2 in (True, False):
        with poisoned():
            outs.append(gk.chunk_states_output_kda_gluon(qf if l2 else kk.l2norm_fwd(qf), kn, G, h0, plan, True, K ** -0.5,
                                                         flags, T=Tm, v=vf, beta=bf, l2norm_q=l2))
    (o_in, ht_in), (o_pre, ht_pre) = outs
    assert not o_in.isnan().any(), "o: a row not written"
    assert torch.equal(o_in, o_pre), f"o: {normwise(o_in, o_pre):.2e} normwise from stage 1's queries' [{layout} K={K}]"
    assert torch.equal(ht_in, ht_pre), f"final state: {normwise(ht_in, ht_pre):.2e} [{layout} K={K}]"


# fused-t forms that must not change the forward's values: (module, switch, the default's
# alternative first, then the form compared with it)
SAME_VALUE_FORMS = {
    # k normalised by stage 3 (the tile kernel, flagged chunks' included) or by stage 1
    "keys-normalised-in": ("triton_kernels", "KEYS_NORMALISED_IN", "stage-1", "stage-3"),
    # T stored by stage 3 in bf16 (rounded as the fused kernel rounds it when it reads fp32 T)
    "t-dtype": ("triton_kernels", "FORWARD_T_DTYPE", "fp32", "input"),
    # q normalised in its tile in place or where the kernel reads it
    "q-norm": ("gluon_kernels", "Q_NORM", "in-place", "registers"),
}


@pytest.mark.parametrize("layout,K", [(lay, K) for lay in LAYOUTS for K in (64, 128)])
@pytest.mark.parametrize("forms", list(SAME_VALUE_FORMS))
def test_forms_leave_the_forward_unchanged(forms, layout, K, device, seed, monkeypatch):
    """The fused-t forward in each pair of SAME_VALUE_FORMS' forms: o and the final state bitwise
    equal (the same bf16 values reach every product, the flagged chunks' included, as the draw
    flags some)."""
    parity._backend_or_skip("gluon", device)
    import importlib

    module_name, switch, first, second = SAME_VALUE_FORMS[forms]
    module = importlib.import_module(f"tileport.ops.kda.{module_name}")
    inputs = _inputs(layout, K, True, device)
    outs = []
    for form in (first, second):
        monkeypatch.setattr(module, switch, form)
        outs.append(_forward("fused-t", inputs, K, True, monkeypatch))
    (o1, ht1), (o2, ht2) = outs
    assert not o2.isnan().any(), f"o: a row not written [{switch} {second!r}, {layout} K={K}]"
    assert torch.equal(o2, o1), f"o [{layout} K={K}]: {normwise(o2, o1):.2e} normwise between {switch}'s forms"
    assert torch.equal(ht2, ht1), f"final state [{layout} K={K}]: {normwise(ht2, ht1):.2e} between {switch}'s forms"


# the fused forward's forms with the backward switches each runs beside (the rest at their defaults):
# "fused-t-u-from-t" the backward from the kept states never forming U (BACKWARD_U_FROM_T);
# "fused-t-states16" the kept h and Vn in bf16 (KEPT_STATES_DTYPE "bf16"); "fused-t-dstates16"
# stage 8's dh and dVn in bf16 (BACKWARD_DSTATES_DTYPE "bf16"); "fused-t-allstates16" both;
# "fused-t-w16" the backward's W in bf16 (BACKWARD_W_DTYPE "bf16"); "fused-t-all16" all three
GATE_FORMS = {
    "fused": ("fused", dict(BACKWARD_U_FROM_T=False)),
    "fused-t": ("fused-t", dict(BACKWARD_U_FROM_T=False)),
    "fused-t-u-from-t": ("fused-t", dict(BACKWARD_U_FROM_T=True)),
    "fused-t-states16": ("fused-t", dict(BACKWARD_U_FROM_T=False, KEPT_STATES_DTYPE="bf16")),
    "fused-t-dstates16": ("fused-t", dict(BACKWARD_DSTATES_DTYPE="bf16")),
    "fused-t-allstates16": ("fused-t", dict(KEPT_STATES_DTYPE="bf16", BACKWARD_DSTATES_DTYPE="bf16")),
    "fused-t-w16": ("fused-t", dict(BACKWARD_W_DTYPE="bf16")),
    "fused-t-all16": ("fused-t", dict(KEPT_STATES_DTYPE="bf16", BACKWARD_DSTATES_DTYPE="bf16",
                                      BACKWARD_W_DTYPE="bf16")),
}


@pytest.mark.parametrize("form", list(GATE_FORMS))
@pytest.mark.parametrize("case_id", [cid for cid, c in parity.CASES.items()
                                     if c[5] == "bf16" and c[3] == c[4] and c[3] in (64, 128)])
def test_gate_cases_with_the_fused_kernel(case_id, form, device, seed, fused, monkeypatch):
    """The gate's accepted cases (forward and backward against the float64 reference, the gate's
    bounds) on the gluon backend with the fused forward in each form (GATE_FORMS), which each
    forward launches once."""
    parity._backend_or_skip("gluon", device)
    from tileport.ops.kda import gluon_kernels as gk
    from tileport.ops.kda import triton_kernels as kk

    recurrence, switches = GATE_FORMS[form]
    monkeypatch.setattr(gk, "FORWARD_RECURRENCE", recurrence)
    for name, value in switches.items():
        monkeypatch.setattr(kk, name, value)
    parity._run_and_check("gluon", case_id, device, seed)
    assert len(fused.grids) == 1, fused.grids


# --------------------------------------------------------------------------------------------
# CPU: the switch, the rule, the launch checks
# --------------------------------------------------------------------------------------------
def _rule(K=128, V=128, **changes):
    from tileport.ops.kda import gluon_kernels as gk

    bf, Ntok, H, NC = torch.bfloat16, 256, 2, 4
    ops = dict(q=operand([Ntok, H, K], bf), k=operand([Ntok, H, K], bf), v=operand([Ntok, H, V], bf),
               G=operand([Ntok, H, K], torch.float32), span_flags=operand([NC, H], torch.int8))
    ops.update(changes)
    return gk.states_output_kernel_for(ops["q"], ops["k"], ops["v"], ops["G"], ops["span_flags"])


def test_switch_is_validated(monkeypatch):
    from tileport.ops.kda import gluon_kernels as gk

    monkeypatch.setattr(gk, "FORWARD_RECURRENCE", "both")
    with pytest.raises(ValueError, match="FORWARD_RECURRENCE 'both'.*'split', 'fused', 'fused-t'"):
        _rule()
    with pytest.raises(ValueError, match="FORWARD_RECURRENCE"):  # validated before any fallback is decided
        _rule(span_flags=None)
    monkeypatch.setattr(gk, "FORWARD_RECURRENCE", "fused-t")
    monkeypatch.setattr(gk, "Q_NORM", "smem")
    with pytest.raises(ValueError, match="Q_NORM 'smem'.*'in-place', 'registers'"):
        _rule(span_flags=None)


def test_t_dtype_switch_is_validated(monkeypatch):
    """FORWARD_T_DTYPE is checked at every forward call, on every machine (not only where the
    fused kernel runs)."""
    from tileport.ops.kda import triton_kernels as kk

    monkeypatch.setattr(kk, "FORWARD_T_DTYPE", "bf16")
    q, k, v, g, beta, _, _ = parity.make_inputs(1, 16, 1, 16, 16, torch.bfloat16, None, False, True, "normal", "rand",
                                                "cpu")
    with pytest.raises(ValueError, match="FORWARD_T_DTYPE 'bf16'.*'fp32', 'input'"):
        kk.kda_forward_triton(q, k, v, g, beta, 0.25, None, False, True, None)


@pytest.mark.parametrize("form", ["fused", "fused-t"])
def test_rule_takes_what_the_kernel_was_compiled_for(form, monkeypatch):
    from tileport.ops.kda import gluon_kernels as gk

    bf, f32 = torch.bfloat16, torch.float32
    monkeypatch.setattr(gk, "FORWARD_RECURRENCE", "split")
    assert _rule() == "split"
    monkeypatch.setattr(gk, "FORWARD_RECURRENCE", form)
    for K in (64, 128):
        assert _rule(K, K) == form, K
    refused = {
        "no flags (fp32 inputs, or DIAGONAL_FORM other than chunk)": dict(span_flags=None),
        "K != V": dict(V=64),
        "K = 32": dict(K=32, V=32),
        "fp32 values (W and U not bf16)": dict(v=operand([256, 2, 128], f32)),
        "fp16 queries": dict(q=operand([256, 2, 128], torch.float16)),
        "fp64 G": dict(G=operand([256, 2, 128], torch.float64)),
        "on the CPU": dict(G=operand([256, 2, 128], f32, is_cuda=False)),
        "strided v": dict(v=operand([256, 2, 128], bf, contiguous=False)),
        "a TMA source off 16 bytes": dict(k=operand([256, 2, 128], bf, data_ptr=1032)),
    }
    for why, change in refused.items():
        assert _rule(**change) == "split", why


def test_launch_checks(monkeypatch):
    from tileport.ops.kda import gluon_kernels as gk

    assert gk.check_recurrence_launch(128) == 128 and gk.check_recurrence_launch(64) == 64
    monkeypatch.setattr(gk, "RECURRENCE_WARPS", 2)
    with pytest.raises(ValueError, match="RECURRENCE_WARPS 2"):
        gk.check_recurrence_launch(128)
    monkeypatch.setattr(gk, "RECURRENCE_WARPS", 8)
    monkeypatch.setattr(gk, "RECURRENCE_BV", 48)
    with pytest.raises(ValueError, match="RECURRENCE_BV 48"):
        gk.check_recurrence_launch(128)
    monkeypatch.setattr(gk, "RECURRENCE_BV", 128)
    monkeypatch.setattr(gk, "RECURRENCE_GATES", "staged")
    with pytest.raises(ValueError, match="RECURRENCE_GATES 'staged'"):
        gk.check_recurrence_launch(128)


def test_fused_stage_takes_one_set_of_vn_operands():
    """`chunk_states_output_kda_gluon` takes W and U, or T, v and beta (and only then raw queries,
    l2norm_q): any other mix is refused by name before anything is launched."""
    from tileport.ops.kda import gluon_kernels as gk

    t = torch.zeros(64, 2, 64, dtype=torch.bfloat16)
    flags = torch.zeros(1, 2, dtype=torch.int8)
    T, beta = torch.zeros(64, 2, 64), torch.zeros(64, 2, dtype=torch.bfloat16)
    for mix in (dict(), dict(w=t), dict(w=t, u=t, T=T, v=t, beta=beta), dict(T=T, v=t), dict(T=T, u=t, beta=beta),
                dict(w=t, v=t)):
        with pytest.raises(ValueError, match="either w and u, or T, v and beta"):
            gk.chunk_states_output_kda_gluon(t, t, t.float(), None, None, False, 1.0, flags, **mix)
    with pytest.raises(ValueError, match="l2norm_q"):
        gk.chunk_states_output_kda_gluon(t, t, t.float(), None, None, False, 1.0, flags, w=t, u=t, l2norm_q=True)
    h, vn = torch.zeros(1, 2, 64, 64), torch.zeros(64, 2, 64)
    with pytest.raises(ValueError, match="states_out: .* Vn-from-T form only"):
        gk.chunk_states_output_kda_gluon(t, t, t.float(), None, None, False, 1.0, flags, w=t, u=t, states_out=(h, vn))
    from tileport.ops.kda import triton_kernels as kk

    plan = kk.make_plan(1, 64, None, t.device)
    for bad in ((h.double(), vn), (h, vn[:32]), (h.transpose(2, 3), vn), (h, vn.bfloat16()), (h.bfloat16(), vn),
                (h.half(), vn.half())):
        with pytest.raises(ValueError, match="states_out must be contiguous h .* both fp32 or both bf16"):
            gk.chunk_states_output_kda_gluon(t, t, t.float(), None, plan, False, 1.0, flags, T=T, v=t, beta=beta,
                                             states_out=bad)


@pytest.mark.parametrize("form,keys,t_dtype", [("split", "stage-1", "input"), ("fused", "stage-1", "input"),
                                               ("fused-t", "stage-1", "input"), ("fused-t", "stage-3", "input"),
                                               ("fused-t", "stage-3", "fp32")])
def test_forward_follows_the_rule_before_stage_3(form, keys, t_dtype, device, seed, monkeypatch):
    """`kda_forward_triton` asks the rule first: "split" never calls the fused stage; "fused" hands
    it stage 3's W and U (and, both fused forms, the flagged chunks' worklist stage 3 formed); "fused-t" runs stage 3 without W and U and hands it T, v and beta, T
    bitwise the T that stage 3 forms beside W and U (the same tile kernel with WITH_WU off, and the
    block kernel's for the flagged chunks). The fused stage is a stand-in here (the Triton stages
    run where the backend does: the interpreter on the CPU). keys: KEYS_NORMALISED_IN (the fused-t
    form's keys normalised by stage 1 or stage 3), the same keys handed on either way. t_dtype:
    FORWARD_T_DTYPE (T handed on in bf16, rounded as stage 3 rounds it, or fp32; no backward keeps
    it here)."""
    parity._backend_or_skip("triton", device)
    from tileport.ops.kda import triton_kernels as kk

    monkeypatch.setattr(kk, "KEYS_NORMALISED_IN", keys)
    monkeypatch.setattr(kk, "FORWARD_T_DTYPE", t_dtype)
    inputs = _inputs("varlen-empty-len1", 64, True, device)
    calls = []
    solve_kwargs = []
    real_solve = kk.chunk_solve_wu

    def solve_spy(*args, **kwargs):
        solve_kwargs.append(kwargs)
        return real_solve(*args, **kwargs)

    monkeypatch.setattr(kk, "chunk_solve_wu", solve_spy)

    def fused_stage(q, k, G, h0, plan, final, scale, flags, worklist=None, **vn_operands):
        calls.append(dict(vn_operands, q=q, k=k))
        worklists.append((worklist.clone() if worklist is not None else None, flags.clone()))
        return torch.zeros_like(q), None

    worklists = []

    o, _ = kk.kda_forward_triton(*inputs[:5], 0.125, inputs[5], False, True, inputs[6],
                                 states_output=fused_stage, states_output_form=lambda *args: form)
    assert len(solve_kwargs) == 1 and solve_kwargs[0].get("with_wu", True) == (form != "fused-t"), solve_kwargs
    assert solve_kwargs[0].get("l2norm_k", False) == (form == "fused-t" and keys == "stage-3"), solve_kwargs
    if form == "split":
        assert calls == [] and not o.isnan().any()
        return
    assert len(calls) == 1
    got = calls[0]
    # the flagged launches' worklist, formed once by stage 3 (the same object it was handed) and handed on
    work, flags_seen = worklists[0]
    assert work is not None and solve_kwargs[0].get("worklist_out") is not None, "the fused stage takes stage 3's worklist"
    flagged = (flags_seen.view(-1) != 0).nonzero().view(-1).to(torch.int32)
    assert work[0].item() == flagged.numel() and torch.equal(work[1:1 + flagged.numel()], flagged), \
        "the worklist: the count of flagged (chunk, head) pairs, then their indices in order"
    qn = kk.l2norm_fwd(kk._flatten(inputs[0]))
    assert torch.equal(got["k"], kk.l2norm_fwd(kk._flatten(inputs[1]))), f"the fused stage's keys ({keys})"
    if form == "fused":
        assert sorted(got) == ["k", "q", "u", "w"] and got["w"].dtype == torch.bfloat16
        assert torch.equal(got["q"], qn), "the fused form takes normalised queries"
        return
    assert sorted(got) == ["T", "beta", "k", "l2norm_q", "q", "states_out", "v"] and got["l2norm_q"] is True
    assert got["states_out"] is None, "a forward no backward keeps stores no states"
    assert torch.equal(got["q"], kk._flatten(inputs[0])), "the fused-t form takes the raw queries and normalises them"
    B, T = inputs[0].shape[:2]
    plan = kk.make_plan(B, T, inputs[6], inputs[0].device)
    H = inputs[0].shape[2]
    flags = torch.empty((plan.NC, H), dtype=torch.int8, device=device)
    gf = kk._flatten(inputs[3])
    kf = kk.l2norm_fwd(kk._flatten(inputs[1]))
    G = torch.empty(gf.shape, dtype=torch.float32, device=device)
    T_with_wu, w, u = real_solve(kf, kk._flatten(inputs[2]), kk._flatten(inputs[4]), G, plan, store_T=True,
                                        compact=True, keys_normalised=True, g=gf, span_flags=flags)
    assert (flags == 0).any() and (flags != 0).any(), f"the draw should flag some chunks and not others: {flags}"
    assert w is not None
    if t_dtype == "fp32":
        assert torch.equal(got["T"], T_with_wu), f"T alone vs T with W and U: {normwise(got['T'], T_with_wu):.2e}"
    else:
        assert rounded_as_kernels_round(got["T"], T_with_wu), f"T alone ({got['T'].dtype}) vs T with W and U rounded"
    assert torch.equal(got["v"], kk._flatten(inputs[2])) and torch.equal(got["beta"], kk._flatten(inputs[4]))


@pytest.mark.parametrize("layout,K", [(lay, K) for lay in LAYOUTS for K in (64, 128)])
def test_stage_3_normalises_the_keys_as_stage_1(layout, K, device, seed):
    """Stage 3 on raw keys with l2norm_k (KEYS_NORMALISED_IN "stage-3": the tile kernel normalises
    each chunk's keys and stores them, a flagged chunk's before it returns) against stage 3 on
    stage 1's normalised keys: the stored keys, T, G and the flags bitwise equal (T of the flagged
    chunks from the block kernel, which reads the stored keys)."""
    parity._backend_or_skip("triton", device)
    from tileport.ops.kda import triton_kernels as kk

    inputs = _inputs(layout, K, False, device)
    B, T = inputs[0].shape[:2]
    H = inputs[0].shape[2]
    plan = kk.make_plan(B, T, inputs[6], inputs[0].device)
    kf, vf, gf, bf = (kk._flatten(inputs[i]) for i in (1, 2, 3, 4))
    outs = []
    for in_stage_3 in (True, False):
        flags = torch.empty((plan.NC, H), dtype=torch.int8, device=device)
        G = torch.empty(gf.shape, dtype=torch.float32, device=device)
        with poisoned():
            kn = torch.full_like(kf, float("nan"))
            extra = dict(l2norm_k=True, kn_out=kn) if in_stage_3 else {}
            Tm, _, _ = kk.chunk_solve_wu(kf if in_stage_3 else kk.l2norm_fwd(kf), vf, bf, G, plan, store_T=True,
                                         compact=True, keys_normalised=True, g=gf, span_flags=flags, with_wu=False,
                                         **extra)
        outs.append((kn if in_stage_3 else kk.l2norm_fwd(kf), Tm, G, flags))
    assert (outs[0][3] == 0).any() and (outs[0][3] != 0).any(), f"the draw should flag some chunks and not others"
    for name, a, b in zip(("normalised keys", "T", "G", "flags"), *outs):
        assert torch.equal(a, b), f"{name} [{layout} K={K}]: stage 3's normalisation differs from stage 1's"


@pytest.mark.parametrize("layout,K", [(lay, K) for lay in LAYOUTS for K in (64, 128)])
def test_stage_3_stores_t_in_16_bits_as_its_reader_rounds_it(layout, K, device, seed):
    """Stage 3's T alone with t_dtype bf16 (FORWARD_T_DTYPE "input") against the fp32 T of the same
    call rounded to bf16 as the kernels round (to nearest even on the GPU; the interpreter's
    emulation, `gdn.triton_kernels._op`, on the CPU): equal, both routes (the block kernel's flagged
    chunks and the tile kernel's others), and G and the flags unchanged."""
    parity._backend_or_skip("triton", device)
    from tileport.ops.kda import triton_kernels as kk

    inputs = _inputs(layout, K, False, device)
    B, T = inputs[0].shape[:2]
    H = inputs[0].shape[2]
    plan = kk.make_plan(B, T, inputs[6], inputs[0].device)
    kn = kk.l2norm_fwd(kk._flatten(inputs[1]))
    vf, gf, bf = (kk._flatten(inputs[i]) for i in (2, 3, 4))
    outs = []
    for t_dtype in (torch.float32, torch.bfloat16):
        flags = torch.empty((plan.NC, H), dtype=torch.int8, device=device)
        G = torch.empty(gf.shape, dtype=torch.float32, device=device)
        with poisoned():
            Tm, _, _ = kk.chunk_solve_wu(kn, vf, bf, G, plan, store_T=True, compact=True, keys_normalised=True, g=gf,
                                         span_flags=flags, with_wu=False, t_dtype=t_dtype)
        outs.append((Tm, G, flags))
    (T32, G32, f32), (T16, G16, f16) = outs
    assert (f32 == 0).any() and (f32 != 0).any(), "the draw should flag some chunks and not others"
    assert rounded_as_kernels_round(T16, T32), f"T [{layout} K={K}]: not fp32 T rounded to bf16"
    assert torch.equal(G16, G32) and torch.equal(f16, f32), f"G or the flags changed with T's dtype [{layout} K={K}]"


def test_stage_3_keeps_fp32_t_but_for_t_alone():
    """t_dtype other than fp32 is for T alone (with_wu=False) in the op's 16-bit dtype: refused by
    name otherwise."""
    from tileport.ops.kda import triton_kernels as kk

    x = torch.zeros(64, 2, 64, dtype=torch.bfloat16)
    plan = kk.make_plan(1, 64, None, x.device)
    flags = torch.zeros(1, 2, dtype=torch.int8)
    for with_wu, t_dtype in ((True, torch.bfloat16), (False, torch.float16)):
        with pytest.raises(ValueError, match="t_dtype"):
            kk.chunk_solve_wu(x, x, x[..., 0], x.float(), plan, store_T=True, compact=True, span_flags=flags,
                              with_wu=with_wu, t_dtype=t_dtype)


def test_worklist_buffer_is_checked():
    """A worklist buffer handed to stage 3 must be int32 [1 + NC * H] on the flags' device, and is
    for the flagged chunks only (span_flags): refused by name otherwise."""
    from tileport.ops.gdn import triton_kernels as gdn_tk
    from tileport.ops.kda import triton_kernels as kk

    flags = torch.zeros(3, 2, dtype=torch.int8)
    for bad in (torch.zeros(6, dtype=torch.int32), torch.zeros(7, dtype=torch.int64)):
        with pytest.raises(ValueError, match="worklist_out must be int32 \\[7\\]"):
            gdn_tk.flagged_worklist(flags, out=bad)
    x = torch.zeros(64, 2, 64, dtype=torch.bfloat16)
    plan = kk.make_plan(1, 64, None, x.device)
    with pytest.raises(ValueError, match="worklist_out needs span_flags"):
        kk.chunk_solve_wu(x, x, x[..., 0], x.float(), plan, compact=True, worklist_out=torch.zeros(3, dtype=torch.int32))


def test_stage_3_without_w_and_u_needs_the_kept_t_form():
    """with_wu=False is the per-channel tile form keeping T (span_flags and store_T): refused by
    name otherwise."""
    from tileport.ops.kda import triton_kernels as kk

    x = torch.zeros(64, 2, 64, dtype=torch.bfloat16)
    plan = kk.make_plan(1, 64, None, x.device)
    for store_T, flags in ((False, torch.zeros(1, 2, dtype=torch.int8)), (True, None)):
        with pytest.raises(ValueError, match="with_wu=False"):
            kk.chunk_solve_wu(x, x, x[..., 0], x.float(), plan, store_T=store_T, compact=True, span_flags=flags,
                              with_wu=False)


# --------------------------------------------------------------------------------------------
# The states a training forward keeps for its backward (triton_kernels.KEEP_FORWARD_STATES)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep_states,kept_dtype", [(True, "fp32"), (True, "bf16"), (False, "fp32")])
def test_keeping_forward_hands_the_fused_stage_its_state_buffers(keep_states, kept_dtype, device, seed, monkeypatch):
    """A keeping fused-t forward hands the fused stage h [NC, H, K, V] and Vn [Ntok, H, V] buffers,
    fp32 or bf16 (KEPT_STATES_DTYPE), to store every chunk's into
    (KEEP_FORWARD_STATES) and keeps those very buffers; with the switch off it hands none and keeps
    none. The fused stage is a stand-in (the Triton stages run where the backend does)."""
    parity._backend_or_skip("triton", device)
    from tileport.ops.kda import triton_kernels as kk

    monkeypatch.setattr(kk, "KEEP_FORWARD_STATES", keep_states)
    monkeypatch.setattr(kk, "KEPT_STATES_DTYPE", kept_dtype)
    inputs = _inputs("varlen-empty-len1", 64, False, device)
    handed = []

    def fused_stage(q, k, G, h0, plan, final, scale, flags, worklist=None, states_out=None, **vn_operands):
        handed.append((plan, states_out))
        return torch.zeros_like(q), None

    _, _, kept = kk.kda_forward_triton(*inputs[:5], 0.125, inputs[5], False, True, inputs[6], keep_for_backward=True,
                                       states_output=fused_stage, states_output_form=lambda *args: "fused-t")
    assert len(handed) == 1 and kept is not None
    plan, states_out = handed[0]
    if not keep_states:
        assert states_out is None and kept.h is None and kept.vn is None
        return
    h, vn = states_out
    Ntok, H, K = kk._flatten(inputs[0]).shape
    assert h.shape == (plan.NC, H, K, K) and vn.shape == (Ntok, H, K)
    want = torch.float32 if kept_dtype == "fp32" else torch.bfloat16
    assert h.dtype == vn.dtype == want and h.is_contiguous() and vn.is_contiguous()
    assert kept.h is h and kept.vn is vn, "the backward gets the buffers the fused stage wrote"
    assert kept.T.dtype == torch.float32, "a keeping forward keeps fp32 T"


def test_backward_takes_kept_states_instead_of_stage_5(device, seed, monkeypatch):
    """Given h and Vn with the tiles it kept, the backward does not run stage 5 and uses them as
    they are: fed the recompute's own h and Vn, its gradients are the recompute's, bitwise. With U
    formed in both (BACKWARD_U_FROM_T off): the default backward from kept states never forms U and
    takes stage 10's dA in another rounding, which test_backward_from_kept_states_without_u bounds."""
    parity._backend_or_skip("triton", device)
    from tileport.ops.kda import triton_kernels as kk

    monkeypatch.setattr(kk, "BACKWARD_U_FROM_T", False)

    q, k, v, g, beta, _, cu = _inputs("varlen-empty-len1", 64, False, device)
    _, _, kept = kk.kda_forward_triton(q, k, v, g, beta, 0.125, None, False, True, cu, keep_for_backward=True)
    assert kept is not None and kept.h is None  # Triton's forward (split stages) stores no states
    do = torch.randn_like(v)
    recomputed = []

    def states_spy(*args, **kwargs):
        recomputed.append(kk.chunk_states(*args, **kwargs))
        return recomputed[-1]

    def no_states(*args, **kwargs):
        raise AssertionError("stage 5 recomputed though the forward's states were kept")

    args = (do, None, q, k, v, g, beta, 0.125, None, True, cu)
    base = kk.kda_backward_triton(*args, kept=kept, states=states_spy)
    assert len(recomputed) == 1
    h, vn, _ = recomputed[0]
    got = kk.kda_backward_triton(*args, kept=kk.KeptTiles(kept.G, kept.T, kept.flags, h, vn), states=no_states)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, base):
        assert torch.equal(a, b), f"{name}: {normwise(a, b):.2e} normwise from the recompute's"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_backward_from_kept_states_without_u(layout, device, seed, monkeypatch):
    """BACKWARD_U_FROM_T: with the states kept, the backward forms W alone (U never), stage 10 takes
    dXu U^T as (dXu (diag(beta) V)^T) T^T (the U_FREE kernels: Triton's for the flagged chunks and on
    the CPU, the Gluon dA kernel for the others on the GPU): dq and dv (upstream of dA) are the
    U-forming backward's bitwise, dk, dg and dbeta within 1e-3 of them (a new rounding in dA, not
    bitwise; the gate's fused-t-u-from-t cases bound them against float64 on the GPU)."""
    parity._backend_or_skip("triton", device)
    from tileport.ops.kda import gluon_kernels as gk
    from tileport.ops.kda import triton_kernels as kk

    q, k, v, g, beta, _, cu = _inputs(layout, 64, False, device)
    _, _, kept = kk.kda_forward_triton(q, k, v, g, beta, 0.125, None, False, True, cu, keep_for_backward=True)
    do = torch.randn_like(v)
    recomputed = []

    def states_spy(*args, **kwargs):
        recomputed.append(kk.chunk_states(*args, **kwargs))
        return recomputed[-1]

    args = (do, None, q, k, v, g, beta, 0.125, None, True, cu)
    kk.kda_backward_triton(*args, kept=kept, states=states_spy)
    h, vn, _ = recomputed[0]
    kept_states = kk.KeptTiles(kept.G, kept.T, kept.flags, h, vn)
    formed = []
    real_wu = kk.chunk_wu_from_t_kda
    monkeypatch.setattr(kk, "chunk_wu_from_t_kda", lambda *a, **kw: formed.append(kw.get("with_u", True))
                        or real_wu(*a, **kw))
    grads = {}
    for u_from_t in (False, True):
        monkeypatch.setattr(kk, "BACKWARD_U_FROM_T", u_from_t)
        grads[u_from_t] = gk.kda_backward_gluon(*args, kept=kept_states)
    assert formed == [True, False], formed
    assert (kept.flags != 0).any() and (kept.flags == 0).any(), "both routes of stage 10 run"
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), grads[True], grads[False]):
        assert not a.isnan().any(), name
        if name in ("dq", "dv"):  # upstream of dA
            assert torch.equal(a, b), f"{name} [{layout}]: {normwise(a, b):.2e} normwise from the U-forming backward's"
        else:  # CPU: dk 2.5e-4 (its bf16 rounding), dg and dbeta 4e-5; T in place of T^T: dk 5.8e-3
            assert normwise(a, b) < 1e-3, f"{name} [{layout}]: {normwise(a, b):.2e} normwise from the U-forming backward's"
    # without kept states U is formed whatever the switch says (stage 5's recompute reads it)
    kk.kda_backward_triton(*args, kept=kept)
    assert formed[-1] is True


@pytest.mark.parametrize("layout,K,h0", [(lay, K, h0) for lay in LAYOUTS for K in (64, 128) for h0 in (True, False)])
def test_kept_states_leave_the_forward_and_are_the_recomputes(layout, K, h0, device, seed, monkeypatch):
    """The fused kernel storing every chunk's h and Vn (STORE_STATES) leaves o and the final state
    bitwise unchanged (the flagged chunks' output now reads them in fp32 and rounds them as the
    kernel does); every row written (poisoned buffers); h and Vn within 2^-6 normwise of the
    backward's recompute of stage 5 (tf32 over W and U from T, where the forward's products take bf16
    operands); and the backward from them within 5e-3 of the backward that recomputes (the gate
    checks both against the float64 reference)."""
    parity._backend_or_skip("gluon", device)
    from tileport.ops.kda import gluon_kernels as gk
    from tileport.ops.kda import triton_kernels as kk

    q, k, v, g, beta, h0_t, cu = _inputs(layout, K, h0, device)
    fargs = (q, k, v, g, beta, K ** -0.5, h0_t, True, True, cu)
    outs = []
    for keep_states in (False, True):
        monkeypatch.setattr(kk, "KEEP_FORWARD_STATES", keep_states)
        with poisoned():
            outs.append(gk.kda_forward_gluon(*fargs, keep_for_backward=True))
    (o1, ht1, kept1), (o2, ht2, kept2) = outs
    assert kept1.h is None and kept2.h is not None
    assert not o2.isnan().any(), f"o: a row not written [{layout} K={K}]"
    assert torch.equal(o2, o1), f"o [{layout} K={K}]: {normwise(o2, o1):.2e} normwise with the states stored"
    assert torch.equal(ht2, ht1), f"final state [{layout} K={K}]: {normwise(ht2, ht1):.2e} with the states stored"
    assert not kept2.h.isnan().any() and not kept2.vn.isnan().any(), f"a chunk's h or a row's Vn not written [{layout}]"
    assert (kept2.flags == 0).any() and (kept2.flags != 0).any(), "the draw should flag some chunks and not others"
    # the backward's recompute of stage 5, from the same kept T
    B, T = q.shape[:2]
    plan = kk.make_plan(B, T, cu, q.device)
    kn = kk.l2norm_fwd(kk._flatten(k), torch.float32)
    w, u = kk.chunk_wu_from_t_kda(kept1.T, kn, kk._flatten(v), kk._flatten(beta), kept1.G, kept1.flags, plan,
                                  q.dtype, keys_normalised=True)
    h_r, vn_r, _ = gk.chunk_states_recompute_gluon(kn, w, u, kept1.G, h0_t, plan, False, input_dtype=q.dtype)
    assert normwise(kept2.h, h_r) <= 2.0 ** -6, f"h [{layout} K={K}]: {normwise(kept2.h, h_r):.2e} from the recompute's"
    assert normwise(kept2.vn, vn_r) <= 2.0 ** -6, f"Vn [{layout} K={K}]: {normwise(kept2.vn, vn_r):.2e} from the recompute's"
    # the flagged chunks' alone too (the kernel stores them on the same path as the others now)
    flagged_chunks, flagged_rows = kept2.flags != 0, route_rows(plan, kept2.flags)[1].to(device)
    for name, a, b in (("h", kept2.h[flagged_chunks], h_r[flagged_chunks]),
                       ("Vn", kept2.vn[flagged_rows], vn_r[flagged_rows])):
        assert normwise(a, b) <= 2.0 ** -6, f"{name} of the flagged chunks [{layout} K={K}]: {normwise(a, b):.2e}"
    do = torch.randn_like(o1)
    bargs = (do, None, q, k, v, g, beta, K ** -0.5, h0_t, True, cu)
    base = gk.kda_backward_gluon(*bargs, kept=kept1)
    got = gk.kda_backward_gluon(*bargs, kept=kept2)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, base):
        if b is None:
            continue
        assert torch.isfinite(a).all(), name
        assert normwise(a, b) <= 5e-3, f"{name} [{layout} K={K}]: {normwise(a, b):.2e} from the recompute's backward"


@pytest.mark.parametrize("layout,K", [(lay, K) for lay in LAYOUTS for K in (64, 128)])
def test_kept_states_in_16_bits_are_the_fp32_ones_rounded(layout, K, device, seed, monkeypatch):
    """KEPT_STATES_DTYPE "bf16": the fused kernel stores every chunk's h and Vn in bf16, bitwise the
    fp32 ones it stores otherwise rounded to nearest even, and o and the final state unchanged; the
    backward takes them (stage 9's Gluon kernel widening them, STATES_16BIT). Its gradients' distance
    from the float64 reference is the gate's business (test_gate_cases_with_the_fused_kernel's
    "fused-t-states16")."""
    parity._backend_or_skip("gluon", device)
    from tileport.ops.kda import gluon_kernels as gk
    from tileport.ops.kda import triton_kernels as kk

    q, k, v, g, beta, h0_t, cu = _inputs(layout, K, True, device)
    fargs = (q, k, v, g, beta, K ** -0.5, h0_t, True, True, cu)
    outs = []
    for kept_dtype in ("fp32", "bf16"):
        monkeypatch.setattr(kk, "KEPT_STATES_DTYPE", kept_dtype)
        with poisoned():
            outs.append(gk.kda_forward_gluon(*fargs, keep_for_backward=True))
    (o32, ht32, kept32), (o16, ht16, kept16) = outs
    assert kept16.h.dtype == kept16.vn.dtype == torch.bfloat16
    assert torch.equal(o16, o32) and torch.equal(ht16, ht32), f"o or the final state moved [{layout} K={K}]"
    assert torch.equal(kept16.h, kept32.h.to(torch.bfloat16)), f"h [{layout} K={K}]"
    assert torch.equal(kept16.vn, kept32.vn.to(torch.bfloat16)), f"Vn [{layout} K={K}]"
    do = torch.randn_like(o32)
    bargs = (do, None, q, k, v, g, beta, K ** -0.5, h0_t, True, cu)
    got = gk.kda_backward_gluon(*bargs, kept=kept16)
    assert all(torch.isfinite(x).all() for x in got if x is not None)
