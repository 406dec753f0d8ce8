"""Every autotune candidate of the GDN kernels computes the same thing.

On a GPU the autotuner may pick any of `SOLVE_WU_OPTIONS`, `STATES_OPTIONS`, `OUTPUT_OPTIONS` or
`DSTATES_OPTIONS` (kernels' block of V, warps and pipeline stages); under the interpreter `_tuned` keeps only the
first. Here each candidate in turn is made the kernel's only config and two parity cases of the
frozen gate (tests/test_gdn_parity.py: varlen with a length-1 and an empty sequence, and V = 80,
which no block of V divides) run forward and backward against the float64 recurrence.
"""

from __future__ import annotations

import pytest
from test_gdn_parity import CASES, _backend_or_skip, _one_thread, _run_and_check  # noqa: F401 (_one_thread: autouse fixture)

import tileport
from tileport.ops.gdn import triton_kernels as tk

KERNELS = {
    "solve_wu": (tk._solve_wu_kernel, tk.SOLVE_WU_OPTIONS),
    "solve_wu_tile": (tk._solve_wu_tile_kernel, tk.SOLVE_WU_TILE_OPTIONS),
    "states": (tk._states_kernel, tk.STATES_OPTIONS),
    "output": (tk._output_kernel, tk.OUTPUT_OPTIONS),
    "dstates": (tk._dstates_kernel, tk.DSTATES_OPTIONS),
}
CANDIDATES = [(name, i) for name, (_, options) in KERNELS.items() for i in range(len(options))]
# Kernels that only one form of a stage launches: (switch, form) that makes the forward use them.
FORM_OF = {"solve_wu": ("SOLVE_FORM", "blocks"), "solve_wu_tile": ("SOLVE_FORM", "tile"),
           "output": ("STATES_FORM", "split")}


@pytest.mark.parametrize("case_id", ["varlen-bf16-l2", "K48-V80-fp32"])
@pytest.mark.parametrize("kernel,index", CANDIDATES, ids=[f"{n}-{i}" for n, i in CANDIDATES])
def test_each_autotune_candidate(kernel, index, case_id, device, seed, monkeypatch):
    _backend_or_skip("triton", device)
    fn, options = KERNELS[kernel]
    monkeypatch.setattr(fn, "configs", tk._configs([options[index]]))
    monkeypatch.setattr(fn, "cache", {})
    # the form that launches this kernel (fp32 cases always take the block form of stage 3)
    if kernel in FORM_OF:
        monkeypatch.setattr(tk, *FORM_OF[kernel])
    _run_and_check("triton", case_id, device, seed)


# The whole frozen gate (tests/test_gdn_parity.py) runs the default forms of stages 3 and 5+6;
# these run it again in the other form of each, so both stay correct and either can be chosen.
OTHER_SOLVE_FORM = {"tile": "blocks", "blocks": "tile"}[tk.SOLVE_FORM]
# (STATES_FORM "auto" picks by the number of (sequence, head) pairs: the CPU cases and most GPU ones
# run split, of the full-size cases S1 (128 pairs) and varlen T=8192 (96) fused and B=1 T=32768 (16)
# split; so "the other form" here is the one the small cases skip)
OTHER_STATES_FORM = "split" if tk.states_form(1) == "fused" else "fused"
# 16-bit cases only: fp32 takes the block form of stage 3 whatever the switch says (ragged T,
# varlen with empty and length-1 sequences, gates near 0 and very negative, binary beta, K = 128)
SIXTEEN_BIT_CASES = [c for c, spec in CASES.items() if spec[5] in ("bf16", "fp16")]


@pytest.mark.parametrize("case_id", SIXTEEN_BIT_CASES)
def test_other_solve_form(case_id, device, seed, monkeypatch):
    _backend_or_skip("triton", device)
    monkeypatch.setattr(tk, "SOLVE_FORM", OTHER_SOLVE_FORM)
    _run_and_check("triton", case_id, device, seed)


def test_solve_form_choice(monkeypatch):
    import torch

    for form in ("blocks", "tile"):
        monkeypatch.setattr(tk, "SOLVE_FORM", form)
        assert tk.solve_form(torch.bfloat16, False) == form
        assert tk.solve_form(torch.float16, False) == form
        assert tk.solve_form(torch.float32, False) == "blocks"  # fp32: exact "ieee" products, block form
        assert tk.solve_form(torch.bfloat16, True) == "blocks"  # KDA's per-channel gates


# The whole frozen gate (every dtype, ragged T, varlen with empty and length-1 sequences, initial
# and final states, gates near 0 and very negative) with the forward's stages 5 and 6 in the other form.
@pytest.mark.parametrize("case_id", list(CASES))
def test_other_states_form(case_id, device, seed, monkeypatch):
    _backend_or_skip("triton", device)
    monkeypatch.setattr(tk, "STATES_FORM", OTHER_STATES_FORM)
    _run_and_check("triton", case_id, device, seed)


@pytest.mark.parametrize("index", range(len(tk.STATES_OPTIONS)))
def test_fused_states_output_each_candidate(index, device, seed, monkeypatch):
    _backend_or_skip("triton", device)
    monkeypatch.setattr(tk, "STATES_FORM", "fused")
    monkeypatch.setattr(tk._states_kernel, "configs", tk._configs([tk.STATES_OPTIONS[index]]))
    monkeypatch.setattr(tk._states_kernel, "cache", {})
    _run_and_check("triton", "varlen-bf16-l2", device, seed)


def test_states_form_choice(monkeypatch):
    monkeypatch.setattr(tk, "STATES_FORM", "auto")
    assert tk.states_form(tk.FUSED_STATES_MIN_PAIRS) == "fused"
    assert tk.states_form(tk.FUSED_STATES_MIN_PAIRS - 1) == "split"
    for form in ("fused", "split"):
        monkeypatch.setattr(tk, "STATES_FORM", form)
        assert tk.states_form(1) == tk.states_form(10**6) == form


# The l2-normalised 16-bit cases of the frozen gate with the forward's stage 3 in each other
# precision of NORMALISED_KEYS_PREC ("tf32x3", one-pass "tf32", "bf16"). Under the interpreter
# tf32x3 is exact, one-pass tf32 is emulated by truncating the operands to tf32 (the coarser of the
# roundings the GPU may apply) and bf16 is rounded explicitly, as on the GPU.
L2_SIXTEEN_BIT_CASES = [c for c in SIXTEEN_BIT_CASES if CASES[c][8]]
OTHER_NORMALISED_KEYS_PRECS = [p for p in ("tf32x3", "tf32", "bf16") if p != tk.NORMALISED_KEYS_PREC]


@pytest.mark.parametrize("prec", OTHER_NORMALISED_KEYS_PRECS)
@pytest.mark.parametrize("case_id", L2_SIXTEEN_BIT_CASES)
def test_other_solve_precision_with_normalised_keys(case_id, prec, device, seed, monkeypatch):
    _backend_or_skip("triton", device)
    monkeypatch.setattr(tk, "SOLVE_FORM", "tile")
    monkeypatch.setattr(tk, "NORMALISED_KEYS_PREC", prec)
    _run_and_check("triton", case_id, device, seed)


# The same cases with the backward's recompute of stage 3 in the other precision
# (RECOMPUTE_NORMALISED_KEYS_PREC: "tf32x3" or one-pass "tf32", emulated as above), and a form it
# does not know refused by the backward.
OTHER_RECOMPUTE_PREC = {"tf32x3": "tf32", "tf32": "tf32x3"}[tk.RECOMPUTE_NORMALISED_KEYS_PREC]


@pytest.mark.parametrize("case_id", L2_SIXTEEN_BIT_CASES)
def test_other_recompute_precision_with_normalised_keys(case_id, device, seed, monkeypatch):
    _backend_or_skip("triton", device)
    monkeypatch.setattr(tk, "SOLVE_FORM", "tile")
    monkeypatch.setattr(tk, "RECOMPUTE_NORMALISED_KEYS_PREC", OTHER_RECOMPUTE_PREC)
    _run_and_check("triton", case_id, device, seed)


# (and the diagonal inverses' precision of that recompute, RECOMPUTE_NORMALISED_KEYS_DIAG_PREC, below)
@pytest.mark.parametrize("switch", ["RECOMPUTE_NORMALISED_KEYS_PREC", "RECOMPUTE_NORMALISED_KEYS_DIAG_PREC"])
def test_unknown_recompute_precision_is_refused(switch, device, monkeypatch):
    import torch

    _backend_or_skip("triton", device)
    monkeypatch.setattr(tk, "SOLVE_FORM", "tile")
    monkeypatch.setattr(tk, switch, "bf16")
    q, k, v, gate, beta, cu = _form_inputs(device)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    o, _ = tileport.chunk_gated_delta_rule(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    with pytest.raises(ValueError, match=switch):
        torch.autograd.grad(o, leaves, torch.ones_like(o))


# The same cases with the forward's inverses of the diagonal 16x16 blocks in the other precision
# (NORMALISED_KEYS_DIAG_PREC: fp32 "ieee" or one-pass "tf32", emulated as above).
OTHER_DIAG_PREC = {"ieee": "tf32", "tf32": "ieee"}[tk.NORMALISED_KEYS_DIAG_PREC]


@pytest.mark.parametrize("case_id", L2_SIXTEEN_BIT_CASES)
def test_other_diagonal_inverse_precision_with_normalised_keys(case_id, device, seed, monkeypatch):
    _gate_case_in(case_id, device, seed, monkeypatch, NORMALISED_KEYS_DIAG_PREC=OTHER_DIAG_PREC)


# And the backward's recompute's diagonal inverses in the other precision
# (RECOMPUTE_NORMALISED_KEYS_DIAG_PREC; a form it does not know is refused: above).
OTHER_RECOMPUTE_DIAG_PREC = {"ieee": "tf32", "tf32": "ieee"}[tk.RECOMPUTE_NORMALISED_KEYS_DIAG_PREC]


@pytest.mark.parametrize("case_id", L2_SIXTEEN_BIT_CASES)
def test_other_recompute_diagonal_inverse_precision(case_id, device, seed, monkeypatch):
    _gate_case_in(case_id, device, seed, monkeypatch, RECOMPUTE_NORMALISED_KEYS_DIAG_PREC=OTHER_RECOMPUTE_DIAG_PREC)


# Every case of the frozen gate with dqkwg in the other block of key columns (DQKWG_KEY_BLOCK: 64
# or 32; K = 48 and 64 then take two blocks, K = 128 four), and a block it cannot take refused.
OTHER_DQKWG_KEY_BLOCK = {64: 32, 32: 64}[tk.DQKWG_KEY_BLOCK]


@pytest.mark.parametrize("case_id", list(CASES))
def test_other_dqkwg_key_block(case_id, device, seed, monkeypatch):
    _gate_case_in(case_id, device, seed, monkeypatch, DQKWG_KEY_BLOCK=OTHER_DQKWG_KEY_BLOCK)


def test_unsupported_dqkwg_key_block_is_refused(monkeypatch):
    monkeypatch.setattr(tk, "DQKWG_KEY_BLOCK", 48)
    with pytest.raises(ValueError, match="DQKWG_KEY_BLOCK"):
        tk._key_split(128)


# Every case of the frozen gate with a backward stage in its other kernel form: DQKWG_FORM ("one"
# kernel, or "split": the chunk-local D terms once per chunk and head, then the state part) and
# WY_BWD_FORM ("one", or "split": dA, dA^T first, then the rest from them); unknown forms refused.
OTHER_BACKWARD_FORMS = {"DQKWG_FORM": {"one": "split", "split": "one"}[tk.DQKWG_FORM],
                        "WY_BWD_FORM": {"one": "split", "split": "one"}[tk.WY_BWD_FORM]}


@pytest.mark.parametrize("switch", list(OTHER_BACKWARD_FORMS))
@pytest.mark.parametrize("case_id", list(CASES))
def test_other_backward_kernel_form(case_id, switch, device, seed, monkeypatch):
    _gate_case_in(case_id, device, seed, monkeypatch, **{switch: OTHER_BACKWARD_FORMS[switch]})


@pytest.mark.parametrize("switch", list(OTHER_BACKWARD_FORMS))
def test_unknown_backward_kernel_form_is_refused(switch, monkeypatch):
    import torch

    monkeypatch.setattr(tk, switch, "fused")
    x = torch.zeros(64, 1, 64)
    state, plan = torch.zeros(1, 1, 64, 64), tk.make_plan(1, 64, None, "cpu")
    with pytest.raises(ValueError, match=switch):
        if switch == "DQKWG_FORM":
            tk.chunk_dqkwg(x, x, x[..., 0], state, state, x, x, x, 1.0, plan, torch.float32)
        else:
            tk.chunk_wy_bwd(x, x, x[..., 0], x[..., 0], x, x, x, x, x, x, x[None, ..., 0], plan, *(torch.float32,) * 4)


# The 16-bit cases of the frozen gate with the backward's products in the other precise form
# (BACKWARD_PRODUCTS: "tf32" or "bf16x3", both on fp32 operands; "bf16" is not a form the gate
# can hold: dg and dbeta of the K = 128 case exceed their bound on ~1 in 130 draws).
OTHER_BACKWARD_PRODUCTS = {"tf32": "bf16x3", "bf16x3": "tf32"}[tk.BACKWARD_PRODUCTS]


@pytest.mark.parametrize("case_id", SIXTEEN_BIT_CASES)
def test_other_backward_products(case_id, device, seed, monkeypatch):
    _backend_or_skip("triton", device)
    monkeypatch.setattr(tk, "BACKWARD_PRODUCTS", OTHER_BACKWARD_PRODUCTS)
    _run_and_check("triton", case_id, device, seed)


# The frozen gate's l2-normalised cases with the fused forward normalising k in each other place
# (L2NORM_K_FORM: "in-kernel", stage 3 and the states kernel normalise on load; "stage-3", stage 3
# normalises on load and stores the keys for the states kernel; fp32 cases keep stage 1: their
# stage 3 is the block form).
L2_CASES = [c for c, spec in CASES.items() if spec[8]]
OTHER_L2NORM_K_FORMS = [f for f in tk.L2NORM_K_FORMS if f != tk.L2NORM_K_FORM]


@pytest.mark.parametrize("form", OTHER_L2NORM_K_FORMS)
@pytest.mark.parametrize("case_id", L2_CASES)
def test_keys_normalised_elsewhere(case_id, form, device, seed, monkeypatch):
    _backend_or_skip("triton", device)
    monkeypatch.setattr(tk, "STATES_FORM", "fused")
    monkeypatch.setattr(tk, "SOLVE_FORM", "tile")
    monkeypatch.setattr(tk, "L2NORM_K_FORM", form)
    _run_and_check("triton", case_id, device, seed)


def _form_inputs(device, seed_value=11, dtype=None, varlen=True):
    """varlen with an empty and a length-1 sequence (or, varlen False, B = 2 of T = 100), V = 80
    (no column block divides it); bf16 unless dtype says otherwise"""
    import torch

    dtype = dtype or torch.bfloat16
    g = torch.Generator().manual_seed(seed_value)
    B, T, H, K, V = (1, 200, 2, 128, 80) if varlen else (2, 100, 2, 128, 80)
    q, k = (torch.randn(B, T, H, K, generator=g).to(dtype).to(device) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g).to(dtype).to(device)
    gate = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=g)).to(device)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g)).to(dtype).to(device)
    cu = torch.tensor([0, 1, 64, 64, 130, 200], device=device) if varlen else None
    return q, k, v, gate, beta, cu


def _assert_same_forward(a_out, b_out, device):
    """bitwise under the interpreter; on a GPU the tensor cores may order a product's partial sums
    differently in two kernels"""
    import torch

    if device == "cpu":
        for a, b in zip(a_out, b_out):
            assert torch.equal(a, b)
    else:
        for a, b in zip(a_out, b_out):
            assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-3


def _gate_case_in(case_id, device, seed, monkeypatch, **switches):
    """One frozen gate case with the tile form of stage 3 and the given module switches set."""
    _backend_or_skip("triton", device)
    monkeypatch.setattr(tk, "SOLVE_FORM", "tile")
    for name, value in switches.items():
        monkeypatch.setattr(tk, name, value)
    _run_and_check("triton", case_id, device, seed)


def _forward_in_each(switch, forms, device, monkeypatch, l2norm=True, gate_scale=1.0, seed_value=11, dtype=None,
                     varlen=True, **fixed):
    """{form: the fused forward's (o, final state)} on the same inputs, one per form of `switch`,
    with every buffer poisoned (an element a form leaves unwritten is NaN)."""
    from tileport.testing import poisoned

    _backend_or_skip("triton", device)
    monkeypatch.setattr(tk, "SOLVE_FORM", "tile")
    monkeypatch.setattr(tk, "STATES_FORM", "fused")
    for name, value in fixed.items():
        monkeypatch.setattr(tk, name, value)
    q, k, v, gate, beta, cu = _form_inputs(device, seed_value, dtype, varlen)
    outs = {}
    for form in forms:
        monkeypatch.setattr(tk, switch, form)
        with poisoned():
            outs[form] = tk.gdn_forward_triton(q, k, v, gate * gate_scale, beta, k.shape[-1] ** -0.5, None, True, l2norm,
                                               cu)
    return outs


@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "dense"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_l2norm_k_forms_compute_the_same_values(dt, varlen, device, monkeypatch):
    # stage 3 stores the keys it normalised on load exactly as stage 1 would have: same forward
    import torch

    outs = _forward_in_each("L2NORM_K_FORM", ("stage-1", "stage-3", "in-kernel"), device, monkeypatch,
                            dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[dt], varlen=varlen)
    _assert_same_forward(outs["stage-3"], outs["stage-1"], device)
    _assert_same_forward(outs["in-kernel"], outs["stage-1"], device)


def test_solve_stage_refuses_what_it_cannot_write(device):
    # kn_out only with keys normalised in the kernel, g (stage 2 in stage 3) only in the tile form
    import torch

    _backend_or_skip("triton", device)
    q, k, v, gate, beta, cu = _form_inputs(device)
    kf, vf, bf, gf = (x.reshape(-1, *x.shape[2:]).contiguous() for x in (k, v, beta, gate))
    plan = tk.make_plan(1, kf.shape[0], cu, device)
    G = tk.chunk_cumsum(gf, plan)
    with pytest.raises(ValueError, match="kn_out"):
        tk.chunk_solve_wu(kf, vf, bf, G, plan, compact=True, kn_out=torch.empty_like(kf))
    with pytest.raises(ValueError, match="g needs the tile form"):
        tk.chunk_solve_wu(kf.float(), vf.float(), bf.float(), G, plan, compact=True, g=gf)


def test_split_wu_form_refuses_the_stage_3_forms(device, monkeypatch):
    # WU_FORM "split" reads stage 1's keys and stage 2's G: with either made in stage 3 it would
    # silently not run, so the forward refuses the pair
    _backend_or_skip("triton", device)
    q, k, v, gate, beta, cu = _form_inputs(device)
    monkeypatch.setattr(tk, "WU_FORM", "split")
    for l2form, cumsum in (("stage-3", "stage-2"), ("stage-1", "stage-3")):
        monkeypatch.setattr(tk, "L2NORM_K_FORM", l2form)
        monkeypatch.setattr(tk, "CUMSUM_FORM", cumsum)
        with pytest.raises(ValueError, match="WU_FORM 'split'"):
            tk.gdn_forward_triton(q, k, v, gate, beta, k.shape[-1] ** -0.5, None, True, True, cu)


# The gate's 16-bit cases with G formed by the other CUMSUM_FORM (stage 2's kernel or stage 3's tile
# solve; only the fused forward takes "stage-3", so the states are fused here), and the two forms'
# forwards compared value for value.
OTHER_CUMSUM_FORM = {"stage-2": "stage-3", "stage-3": "stage-2"}[tk.CUMSUM_FORM]


@pytest.mark.parametrize("case_id", SIXTEEN_BIT_CASES)
def test_other_cumsum_form(case_id, device, seed, monkeypatch):
    _gate_case_in(case_id, device, seed, monkeypatch, STATES_FORM="fused", CUMSUM_FORM=OTHER_CUMSUM_FORM)


@pytest.mark.parametrize("l2norm", [True, False], ids=["l2", "raw-keys"])
def test_cumsum_forms_compute_the_same_values(l2norm, device, monkeypatch):
    outs = _forward_in_each("CUMSUM_FORM", ("stage-2", "stage-3"), device, monkeypatch, l2norm=l2norm, gate_scale=8.0,
                            seed_value=12)
    _assert_same_forward(outs["stage-3"], outs["stage-2"], device)


# The gate's 16-bit cases (forward and backward: the recompute takes the tile form too) with
# stage 3's T formed by the other T_CHAIN.
OTHER_T_CHAIN = {"horner": "factored", "factored": "horner"}[tk.T_CHAIN]


@pytest.mark.parametrize("case_id", SIXTEEN_BIT_CASES)
def test_other_t_chain(case_id, device, seed, monkeypatch):
    _gate_case_in(case_id, device, seed, monkeypatch, T_CHAIN=OTHER_T_CHAIN)


@pytest.mark.parametrize("switch,value", [("T_CHAIN", "neumann"), ("CUMSUM_FORM", "stage-4"),
                                          ("L2NORM_K_FORM", "stage-2"), ("WU_FORM", "triple"),
                                          ("NORMALISED_KEYS_DIAG_PREC", "bf16")])
def test_unknown_forward_form_is_refused(switch, value, device, monkeypatch):
    _backend_or_skip("triton", device)
    monkeypatch.setattr(tk, "SOLVE_FORM", "tile")
    monkeypatch.setattr(tk, "STATES_FORM", "fused")
    monkeypatch.setattr(tk, switch, value)
    q, k, v, gate, beta, cu = _form_inputs(device)
    with pytest.raises(ValueError, match=switch):
        tk.gdn_forward_triton(q, k, v, gate, beta, k.shape[-1] ** -0.5, None, True, True, cu)


# The gate's 16-bit cases with the forward's stage 3 in the other WU_FORM ("fused": T, W and U
# in one kernel; "split": T, then W and U in column blocks from T stored in bf16).
OTHER_WU_FORM = {"fused": "split", "split": "fused"}[tk.WU_FORM]


@pytest.mark.parametrize("case_id", SIXTEEN_BIT_CASES)
def test_other_wu_form(case_id, device, seed, monkeypatch):
    # the split form takes normalised keys only, so stage 1 normalises them
    _gate_case_in(case_id, device, seed, monkeypatch, WU_FORM=OTHER_WU_FORM, L2NORM_K_FORM="stage-1",
                  CUMSUM_FORM="stage-2")


def test_wu_forms_compute_the_same_values(device, monkeypatch):
    # the same roundings in both forms (normalised keys; the split form takes them from stage 1)
    outs = _forward_in_each("WU_FORM", ("fused", "split"), device, monkeypatch, L2NORM_K_FORM="stage-1",
                            CUMSUM_FORM="stage-2")
    _assert_same_forward(outs["fused"], outs["split"], device)
