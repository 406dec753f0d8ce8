"""KDA's backward stage 9 on the Gluon kernel (`gluon_kernels._kda_dqkwg_wgmma_kernel`, BACKWARD_DQKWG
"gluon"): the chunks stage 3 left unflagged on it, the flagged ones on Triton's kernel into the same
buffers (`chunk_dqkwg_kda_gluon`). On the GPU: the stage against Triton's fused stage 9 on the same
inputs (captured from a real backward), route by route, and the whole forward and backward through
`tileport.chunk_kda` against the float64 reference (the parity gate's cases). On the CPU: the
switch's validation, the rule that picks the kernel, and that the gluon backend's backward routes
stage 9 through it; tests/test_gluon_compile.py compile-checks the kernel for sm_90a.
"""

from __future__ import annotations

import pytest
import test_kda_parity as parity  # a module import: pytest would collect imported test functions
import torch
from kda_stage_cases import KEYS, LAYOUTS, capture_stage, gluon_stage_calls, normwise, route_rows
from standins import operand, spy_on_kernels
from test_kda_gluon import ACCEPTED
from test_kda_parity import _one_thread  # noqa: F401 (autouse fixture)

from tileport.testing import poisoned


@pytest.fixture
def gluon_stage9(monkeypatch):
    """BACKWARD_DQKWG "gluon", and the Gluon kernel's launches recorded (their grids)."""
    from tileport.ops.kda import gluon_kernels as gk

    return spy_on_kernels(monkeypatch, gk, ["_kda_dqkwg_wgmma_kernel"], BACKWARD_DQKWG="gluon")[0]


# which state tiles stage 9 is given in bf16: none, h and Vn (the forward's kept states in
# KEPT_STATES_DTYPE "bf16"), dh and dVn (stage 8's in BACKWARD_DSTATES_DTYPE "bf16"), all four
STATES_16BIT = {"fp32": (), "h-vn-bf16": (3, 5), "dh-dvn-bf16": (4, 6), "all-bf16": (3, 4, 5, 6)}


@pytest.mark.parametrize("states", list(STATES_16BIT))
@pytest.mark.parametrize("tiles", ["loads", "tma"])
@pytest.mark.parametrize("keys", list(KEYS))
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stage9_matches_triton_route_by_route(layout, K, keys, tiles, states, device, seed, gluon_stage9, monkeypatch):
    """Every output of `chunk_dqkwg_kda_gluon` (dq, dk, dw, dG; dP's slice 0 on the flagged chunks, the
    only rows read after stage 9) against Triton's `chunk_dqkwg_kda` with fuse_9b on the same inputs,
    on the rows of unflagged chunks (the Gluon kernel's) and of flagged ones (Triton's kernel in both)
    apart, so that an error in either route cannot hide in the other's mass. Outputs are NaN-poisoned:
    a chunk no route writes fails. Under each of the keys stage 9 may read (kda_stage_cases.KEYS: raw
    bf16, l2-normalised in fp32 or in bf16), with dO and the epilogue's G, q, k by pointer loads or by
    TMA (DQKWG_TILES; the TMA form takes bf16 keys only: with fp32 ones the launch is the loads form's);
    the TMA form's outputs are bitwise the loads form's on the unflagged rows (the same values read,
    the same arithmetic). With states other than "fp32" some state tiles are given in bf16
    (STATES_16BIT above), which both kernels widen to the same fp32 values (the kernel's STATES_16BIT
    and DSTATES_16BIT).
    Bound: 1e-5 normwise per output and route, the repo's bound for "the same products, summed in
    another order" (tests/test_kda_chunk_flags.py `_same`). Why it holds: both kernels multiply the
    same fp32 operands by tf32 WGMMA, truncating them alike (Triton's sm_90a PTX for this kernel has
    m64n32k8 tf32 WGMMAs and no cvt.rna; the Gluon kernel's N is 32 per warpgroup too), over V in
    the same k-step order; the epilogues have the same exponents, masks and order of sums; what may
    differ is fp32 rounding: accumulation order (Triton sums V in two blocks of 64 at V = 128),
    contraction of multiply-adds, and rowsum(h * dh)'s reduction tree. A torch transcription of the
    Gluon kernel's arithmetic agreed with Triton's interpreter to <= 2.8e-6 normwise (CPU, tf32
    truncated), with CPU matmuls in other summation orders. On the H200 (e3efcbc) every case held
    it; the whole backward's worst gradient at S1 was 5.4e-6 from Triton's (kda_ab "dqkwg")."""
    parity._backend_or_skip("gluon", device)
    from tileport.ops.kda import gluon_kernels as gk
    from tileport.ops.kda import triton_kernels as kk

    l2, normalised_qk = KEYS[keys]
    monkeypatch.setattr(gk, "DQKWG_TILES", tiles)
    args, kwargs = capture_stage("dqkwg", layout, K, l2, device, normalised_qk)
    args = tuple(x.to(torch.bfloat16) if i in STATES_16BIT[states] else x for i, x in enumerate(args))
    flags, plan = kwargs["span_flags"], args[9]
    assert kwargs["fuse_9b"] and flags is not None
    assert (flags == 0).any() and (flags != 0).any(), f"the draw should flag some chunks and not others: {flags}"
    assert args[0].dtype == (torch.float32 if keys == "l2norm-fp32" else torch.bfloat16), (keys, args[0].dtype)
    want = kk.chunk_dqkwg_kda(*args, **kwargs)

    flagged_launches = []
    real = kk.chunk_dqkwg_kda
    monkeypatch.setattr(kk, "chunk_dqkwg_kda",
                        lambda *a, **kw: flagged_launches.append(kw.get("outputs") is not None) or real(*a, **kw))
    with poisoned():
        got = gk.chunk_dqkwg_kda_gluon(*args, **kwargs)
    assert gluon_stage9.grids == [(plan.NC * K // gk.DQKWG_BKS, flags.shape[1])], gluon_stage9.grids
    tma_tiles = tiles == "tma" and keys != "l2norm-fp32"
    assert gluon_stage9.kwargs[0].get("TMA_TILES", False) == tma_tiles, (tiles, keys, gluon_stage9.kwargs[0].keys())
    launch = gluon_stage9.kwargs[0]
    assert launch["STATES_16BIT"] == (3 in STATES_16BIT[states]), launch.keys()
    assert launch["DSTATES_16BIT"] == (4 in STATES_16BIT[states]), launch.keys()
    assert flagged_launches == [True], flagged_launches  # Triton's kernel, flagged chunks only, into our buffers

    unflagged, flagged = (m.to(args[0].device) for m in route_rows(plan, flags))
    where = f"[{layout} K={K} {keys} {tiles} {states} states seed={seed}]"
    for name, a, b in zip(("dq", "dk", "dw", "dG"), got[:4], want[:4]):
        for route, rows in (("unflagged", unflagged), ("flagged", flagged)):
            err = normwise(a[rows], b[rows])
            assert err < 1e-5, f"{name} on {route} chunks {where}: normwise difference {err:.2e} from Triton's"
    err = normwise(got[4][flagged], want[4][flagged])
    assert err < 1e-5, f"dP slice 0 on flagged chunks {where}: normwise difference {err:.2e} from Triton's"
    if tma_tiles:
        # the TMA form reads the same values and computes as the loads form does: bitwise theirs
        monkeypatch.setattr(gk, "DQKWG_TILES", "loads")
        loads = gk.chunk_dqkwg_kda_gluon(*args, **kwargs)
        assert gluon_stage9.kwargs[-1].get("TMA_TILES", False) is False
        for name, a, b in zip(("dq", "dk", "dw", "dG"), got[:4], loads[:4]):
            assert torch.equal(a[unflagged], b[unflagged]), f"{name} on unflagged chunks {where}: TMA form != loads form"


@pytest.mark.parametrize("case_id", ACCEPTED)
def test_forward_backward(case_id, device, seed, gluon_stage9):
    """The parity gate's cases that the gluon backend takes (bf16, K = V of 64 or 128), forward and
    backward through `tileport.chunk_kda`, with stage 9 on the Gluon kernel: against the float64
    reference at the gate's bounds; and the kernel launched once per backward (its programs return
    on flagged chunks: "split" cases flag most, "normal" and "near0" ones none)."""
    parity._backend_or_skip("gluon", device)
    parity._run_and_check("gluon", case_id, device, seed)
    assert len(gluon_stage9.grids) == 1, gluon_stage9.grids


@pytest.mark.parametrize("states", [s for s in STATES_16BIT if s != "fp32"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_triton_stage9_widens_16bit_states(layout, states, device, seed):
    """Triton's stage 9 (the flagged chunks' kernel beside the Gluon one, and the whole stage where
    the rule refuses) given state tiles in bf16 (STATES_16BIT: the forward's kept h and Vn, stage 8's
    dh and dVn, or all four) computes bitwise what it computes from fp32 tiles holding the same
    values: it widens them on load. Runs on the CPU (interpreter) and the GPU."""
    parity._backend_or_skip("triton", device)
    from tileport.ops.kda import triton_kernels as kk

    args, kwargs = capture_stage("dqkwg", layout, 64, True, device)
    given = tuple(x.to(torch.bfloat16) if i in STATES_16BIT[states] else x for i, x in enumerate(args))
    for i in STATES_16BIT[states]:
        assert not torch.equal(given[i].float(), args[i]), f"argument {i}: the draw's values are bf16 ones already"
    widened = tuple(x.float() if i in STATES_16BIT[states] else x for i, x in enumerate(given))
    outs = []
    for a in (given, widened):
        with poisoned():
            outs.append(kk.chunk_dqkwg_kda(*a, **kwargs))
    for name, a, b in zip(("dq", "dk", "dw", "dG", "dP"), *outs):
        assert torch.equal(a, b), f"{name} [{layout} {states}]: bf16 states != the same values in fp32"


# --------------------------------------------------------------------------------------------
# CPU: the switch, the rule, the plumbing
# --------------------------------------------------------------------------------------------
class _Operand:
    """A tensor as `dqkwg_kernel_for` sees it: shape, dtype, is_cuda, is_contiguous()."""

    def __init__(self, shape, dtype, is_cuda=True, contiguous=True):
        self.shape, self.dtype, self.is_cuda, self._contiguous = torch.Size(shape), dtype, is_cuda, contiguous

    def is_contiguous(self) -> bool:
        return self._contiguous


def _rule_operands(K=128, V=128, keys=torch.float32, **changes):
    """dqkwg_kernel_for's tensor arguments as the gluon backward hands them (l2norm keys by default);
    `changes` replaces some by name."""
    f32, Ntok, H, NC = torch.float32, 256, 2, 4
    ops = dict(q=_Operand([Ntok, H, K], keys), k=_Operand([Ntok, H, K], keys), G=_Operand([Ntok, H, K], f32),
               h=_Operand([NC, H, K, V], f32), dh=_Operand([NC, H, K, V], f32), vn=_Operand([Ntok, H, V], f32),
               dvn=_Operand([Ntok, H, V], f32), do=_Operand([Ntok, H, V], torch.bfloat16),
               span_flags=_Operand([NC, H], torch.int8))
    ops.update(changes)
    return ops


def _rule(ops, fuse_9b=True, input_dtype=torch.bfloat16):
    from tileport.ops.kda import gluon_kernels as gk

    return gk.dqkwg_kernel_for(ops["q"], ops["k"], ops["G"], ops["h"], ops["dh"], ops["vn"], ops["dvn"], ops["do"],
                               input_dtype, ops["span_flags"], fuse_9b)


def test_switch_is_validated(monkeypatch):
    from tileport.ops.kda import gluon_kernels as gk

    monkeypatch.setattr(gk, "BACKWARD_DQKWG", "cuda")
    with pytest.raises(ValueError, match="BACKWARD_DQKWG 'cuda'.*'triton', 'gluon'"):
        _rule(_rule_operands())
    with pytest.raises(ValueError, match="BACKWARD_DQKWG"):  # validated before any fallback is decided
        _rule(_rule_operands(span_flags=None))
    monkeypatch.setattr(gk, "BACKWARD_DQKWG", "gluon")
    monkeypatch.setattr(gk, "DQKWG_TILES", "smem")
    with pytest.raises(ValueError, match="DQKWG_TILES 'smem'.*'tma', 'loads'"):
        _rule(_rule_operands(span_flags=None))


def test_tma_tiles_take_what_their_slots_hold():
    """The TMA_TILES form (DQKWG_TILES "tma") borrows slots sized for bf16 q, k and dO and fp32 G, and
    TMA needs 16-byte aligned storage: anything else keeps the pointer loads."""
    from tileport.ops.kda import gluon_kernels as gk

    bf, f32 = torch.bfloat16, torch.float32

    def fits(q=bf, k=bf, G=f32, do=bf, misaligned=()):
        shape = [256, 2, 128]
        return gk._dqkwg_tma_fits(*(operand(shape, dt, data_ptr=8 if name in misaligned else 1024)
                                    for name, dt in (("q", q), ("k", k), ("G", G), ("do", do))))

    assert fits()
    for why, case in {"fp32 keys": dict(q=f32, k=f32), "fp32 q": dict(q=f32), "fp64 G": dict(G=torch.float64),
                      "fp16 dO": dict(do=torch.float16), "fp16 keys": dict(q=torch.float16, k=torch.float16)}.items():
        assert not fits(**case), why
    for name in ("q", "k", "G", "do"):
        assert not fits(misaligned=(name,)), name


def test_rule_takes_what_the_kernel_was_compiled_for(monkeypatch):
    from tileport.ops.gdn import triton_kernels as tk
    from tileport.ops.kda import gluon_kernels as gk

    f32, bf = torch.float32, torch.bfloat16
    monkeypatch.setattr(gk, "BACKWARD_DQKWG", "triton")
    assert _rule(_rule_operands()) == "triton"
    monkeypatch.setattr(gk, "BACKWARD_DQKWG", "gluon")
    for K in (64, 128):
        for keys in (f32, bf):
            assert _rule(_rule_operands(K, K, keys)) == "gluon", (K, keys)
    # the forward's kept h and Vn in bf16 (KEPT_STATES_DTYPE "bf16"): the kernel widens them
    assert _rule(_rule_operands(h=_Operand([4, 2, 128, 128], bf), vn=_Operand([256, 2, 128], bf))) == "gluon"
    # stage 8's dh and dVn in bf16 (BACKWARD_DSTATES_DTYPE "bf16"), alone and with h and Vn: widened too
    assert _rule(_rule_operands(dh=_Operand([4, 2, 128, 128], bf), dvn=_Operand([256, 2, 128], bf))) == "gluon"
    assert _rule(_rule_operands(h=_Operand([4, 2, 128, 128], bf), vn=_Operand([256, 2, 128], bf),
                                dh=_Operand([4, 2, 128, 128], bf), dvn=_Operand([256, 2, 128], bf))) == "gluon"
    refused = {
        "no flags": _rule_operands(span_flags=None),
        "K != V": _rule_operands(128, 64),
        "K = 32": _rule_operands(32, 32),
        "q, k of two dtypes": _rule_operands(k=_Operand([256, 2, 128], bf)),
        "fp64 G (compiled, never run on the GPU)": _rule_operands(G=_Operand([256, 2, 128], torch.float64)),
        "fp16 keys": _rule_operands(keys=torch.float16),
        "bf16 h alone": _rule_operands(h=_Operand([4, 2, 128, 128], bf)),
        "bf16 Vn alone": _rule_operands(vn=_Operand([256, 2, 128], bf)),
        "bf16 dh alone": _rule_operands(dh=_Operand([4, 2, 128, 128], bf)),
        "bf16 dVn alone": _rule_operands(dvn=_Operand([256, 2, 128], bf)),
        "fp16 dh and dVn": _rule_operands(dh=_Operand([4, 2, 128, 128], torch.float16),
                                          dvn=_Operand([256, 2, 128], torch.float16)),
        "fp16 states": _rule_operands(h=_Operand([4, 2, 128, 128], torch.float16),
                                      vn=_Operand([256, 2, 128], torch.float16)),
        "fp32 dO": _rule_operands(do=_Operand([256, 2, 128], f32)),
        "on the CPU": _rule_operands(vn=_Operand([256, 2, 128], f32, is_cuda=False)),
        "strided": _rule_operands(q=_Operand([256, 2, 128], f32, contiguous=False)),
    }
    for why, ops in refused.items():
        assert _rule(ops) == "triton", why
    assert _rule(_rule_operands(), fuse_9b=False) == "triton"  # 9b apart: Triton's unfused stage 9
    assert _rule(_rule_operands(), input_dtype=torch.float32) == "triton"  # fp32 inputs: exact products
    monkeypatch.setattr(tk, "BACKWARD_PRODUCTS", "bf16x3")
    assert _rule(_rule_operands()) == "triton"


def test_gluon_backward_runs_stage9_through_the_gluon_stage(monkeypatch):
    """Plumbing: `kda_backward_gluon` hands stage 9 to `chunk_dqkwg_kda_gluon` with the flags and 9b
    fused; off the GPU that stage falls back to Triton's, so the gradients are Triton's backward's,
    bitwise, with the switch on."""
    calls = gluon_stage_calls(monkeypatch, "BACKWARD_DQKWG", "chunk_dqkwg_kda_gluon")
    assert len(calls) == 1 and calls[0]["fuse_9b"] and calls[0]["span_flags"] is not None, calls


def test_flagged_only_launch_needs_the_fused_route():
    """`chunk_dqkwg_kda(outputs=...)` (Triton's kernel on the flagged chunks only, beside the Gluon
    kernel) is the fused route's (fuse_9b, span_flags): asked otherwise it says so."""
    from tileport.ops.kda import triton_kernels as kk

    flags = torch.zeros(1, 1, dtype=torch.int8)
    args = (None,) * 8 + (1.0, None, torch.bfloat16)
    with pytest.raises(ValueError, match="needs fuse_9b"):
        kk.chunk_dqkwg_kda(*args, span_flags=flags, fuse_9b=False, outputs=(None,) * 5)
    with pytest.raises(ValueError, match="needs span_flags"):
        kk.chunk_dqkwg_kda(*args, span_flags=None, fuse_9b=True, outputs=(None,) * 5)
