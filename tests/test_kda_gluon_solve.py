"""KDA's forward stage 3 on the Gluon kernel (`gluon_kernels._kda_solve_wgmma_kernel`, FORWARD_SOLVE
"gluon"): G and the flags of every chunk, T, W and U of the unflagged ones; Triton's block kernel the
flagged ones into the same buffers (`chunk_solve_wu_kda_gluon`). On the GPU: the stage against
Triton's (`chunk_solve_wu`, the tile kernel) on the same inputs, captured from a real forward, route
by route, and the gluon backend's forward launching it where it should. On the CPU: the switch's
validation, the rule, the flag threshold shared with Triton's kernel, and the plumbing;
tests/test_gluon_compile.py compile-checks the kernel for sm_90a. The whole forward and backward
against the float64 reference run in tests/test_kda_gluon.py and test_kda_parity.py (gluon cases).
"""

from __future__ import annotations

import inspect

import pytest
import test_kda_parity as parity  # a module import: pytest would collect imported test functions
import torch
from kda_stage_cases import LAYOUTS, normwise, route_rows
from standins import operand, spy_on_kernels
from test_kda_parity import _one_thread  # noqa: F401 (autouse fixture)

from tileport.testing import poisoned


@pytest.fixture
def gluon_solve(monkeypatch):
    """FORWARD_SOLVE "gluon", and the Gluon kernel's launches recorded (their grids)."""
    from tileport.ops.kda import gluon_kernels as gk

    return spy_on_kernels(monkeypatch, gk, ["_kda_solve_wgmma_kernel"], FORWARD_SOLVE="gluon")[0]


def capture_solve(layout: str, K: int, keep: bool, device: str):
    """(args, kwargs) of stage 3 in a real forward (`kda_forward_triton`, through its solve
    parameter): bf16 inputs with l2-normalised keys (the Gluon kernel's case), K = V, H = 2, some
    chunks flagged (LAYOUTS' steep tokens) and some not; keep: the forward keeps T for its backward."""
    from tileport.ops.gdn import triton_kernels as gdn_tk
    from tileport.ops.kda import triton_kernels as kk

    cu, B, T, (lo, hi) = LAYOUTS[layout]
    q, k, v, g, beta, h0, cu_t = parity.make_inputs(B, T, 2, K, K, torch.bfloat16, cu, True, True, "normal", "rand",
                                                    device)
    g[0, lo:hi, 0] = -20.0 - 10.0 * torch.rand(hi - lo, K, device=device)
    captured = []

    def spy(*args, **kwargs):
        captured.append((args, kwargs))
        return gdn_tk.chunk_solve_wu(*args, **kwargs)

    kk.kda_forward_triton(q, k, v, g, beta, K ** -0.5, h0, False, True, cu_t, keep_for_backward=keep, solve=spy)
    assert len(captured) == 1
    return captured[0]


def _fresh_outputs(args, kwargs):
    """The stage's arguments with fresh G and flags buffers (both are outputs of stage 3), poisoned."""
    G = torch.full_like(args[3], float("nan"))
    flags = torch.full_like(kwargs["span_flags"], 7)
    return args[:3] + (G,) + args[4:], dict(kwargs, span_flags=flags)


@pytest.mark.parametrize("keep", [True, False], ids=["keep-T", "no-T"])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_solve_matches_triton_route_by_route(layout, K, keep, device, seed, gluon_solve):
    """Every output of `chunk_solve_wu_kda_gluon` (G, the flags, T when kept, W, U) against Triton's
    `chunk_solve_wu` on the same inputs, on the rows of unflagged chunks (the Gluon kernel's) and of
    flagged ones (Triton's block kernel in both, from G) apart: bitwise equal. Outputs are
    NaN-poisoned: a chunk no route writes fails.
    Why bitwise: both kernels round the same operands to bf16 at the same points (K e^d, K e^-d, D,
    A_off, M, each Horner iterate, T, the W and U operands), multiply them on tensor cores in the
    same k order (the Gluon kernel's block-diagonal [64, 64] inverse against Triton's batched 16x16
    dots: its extra products are exact zeros), and sum g in fp64 before one rounding to fp32 (the
    scans may add in other orders: with these gates the fp64 sums round alike); on the H200 every
    case here and the bench shape agreed to the bit (kda_ab "solve", docs/perf/kda.md row 24). A
    difference means the two kernels' arithmetic diverged: find where before accepting a bound."""
    parity._backend_or_skip("gluon", device)
    from tileport.ops.gdn import triton_kernels as gdn_tk
    from tileport.ops.kda import gluon_kernels as gk

    args, kwargs = capture_solve(layout, K, keep, device)
    plan = args[4]
    assert kwargs["keys_normalised"] and kwargs["g"] is not None and kwargs["store_T"] == keep
    assert gk.solve_kernel_for(args[0], args[1], args[3], kwargs["g"], kwargs["span_flags"], kwargs["compact"],
                               kwargs["keys_normalised"]) == "gluon"
    want_args, want_kwargs = _fresh_outputs(args, kwargs)
    want = gdn_tk.chunk_solve_wu(*want_args, **want_kwargs)
    got_args, got_kwargs = _fresh_outputs(args, kwargs)
    with poisoned():
        got = gk.chunk_solve_wu_kda_gluon(*got_args, **got_kwargs)
    assert gluon_solve.grids == [(plan.NC, 2)], gluon_solve.grids

    where = f"[{layout} K={K} keep={keep} seed={seed}]"
    flags = want_kwargs["span_flags"]
    assert torch.equal(got_kwargs["span_flags"], flags), f"flags {where}"
    assert (flags == 0).any() and (flags != 0).any(), f"the draw should flag some chunks and not others: {flags}"
    G_want, G_got = want_args[3], got_args[3]
    assert not G_got.isnan().any(), f"G not written everywhere {where}"
    assert torch.equal(G_got, G_want), f"G {where}: {normwise(G_got, G_want):.2e} normwise from Triton's"
    assert (got[0] is None) == (not keep)
    unflagged, flagged = (m.to(device) for m in route_rows(plan, flags))
    for name, a, b in zip(("T", "W", "U"), got, want):
        if a is None:
            continue
        for route, rows in (("unflagged", unflagged), ("flagged", flagged)):
            assert not a[rows].isnan().any(), f"{name} on {route} chunks {where}: not written"
            assert torch.equal(a[rows], b[rows]), (f"{name} on {route} chunks {where}: normwise difference "
                                                   f"{normwise(a[rows], b[rows]):.2e} from Triton's")


@pytest.mark.parametrize("form, l2, launches", [("split", True, 1), ("split", False, 0), ("fused-t", True, 0)],
                         ids=["split-l2norm", "split-raw-keys", "fused-t-l2norm"])
def test_gluon_forward_launches_the_solve_kernel(form, l2, launches, device, gluon_solve, monkeypatch):
    """The gluon backend's forward forms stage 3 on the Gluon kernel for l2-normalised keys (once per
    forward) and on Triton's for raw keys (whose products Triton's kernel takes at tf32x3), in the
    forward forms whose stage 3 forms W and U ("split", "fused"); the default "fused-t" stops stage 3
    at T, which only Triton's kernel forms (with the keys' normalisation: KEYS_NORMALISED_IN)."""
    parity._backend_or_skip("gluon", device)
    import tileport
    from tileport.dispatch import use_backend
    from tileport.ops.kda import gluon_kernels as gk

    monkeypatch.setattr(gk, "FORWARD_RECURRENCE", form)
    q, k, v, g, beta, h0, cu_t = parity.make_inputs(1, 130, 2, 64, 64, torch.bfloat16, None, True, l2, "normal",
                                                    "rand", device)
    with use_backend("gluon", op="kda"):
        tileport.chunk_kda(q, k, v, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=l2)
    assert len(gluon_solve.grids) == launches, gluon_solve.grids


# --------------------------------------------------------------------------------------------
# CPU: the switch, the rule, the threshold, the plumbing
# --------------------------------------------------------------------------------------------
def _rule(K=128, V=128, compact=True, keys_normalised=True, **changes):
    from tileport.ops.kda import gluon_kernels as gk

    bf, f32, Ntok, H, NC = torch.bfloat16, torch.float32, 256, 2, 4
    ops = dict(k=operand([Ntok, H, K], bf), v=operand([Ntok, H, V], bf), G=operand([Ntok, H, K], f32),
               g=operand([Ntok, H, K], f32), span_flags=operand([NC, H], torch.int8))
    ops.update(changes)
    return gk.solve_kernel_for(ops["k"], ops["v"], ops["G"], ops["g"], ops["span_flags"], compact, keys_normalised)


def test_switch_is_validated(monkeypatch):
    from tileport.ops.kda import gluon_kernels as gk

    monkeypatch.setattr(gk, "FORWARD_SOLVE", "cuda")
    with pytest.raises(ValueError, match="FORWARD_SOLVE 'cuda'.*'triton', 'gluon'"):
        _rule()
    with pytest.raises(ValueError, match="FORWARD_SOLVE"):  # validated before any fallback is decided
        _rule(span_flags=None)


def test_rule_takes_what_the_kernel_was_compiled_for(monkeypatch):
    from tileport.ops.gdn import triton_kernels as gdn_tk
    from tileport.ops.kda import gluon_kernels as gk

    bf, f32 = torch.bfloat16, torch.float32
    monkeypatch.setattr(gk, "FORWARD_SOLVE", "triton")
    assert _rule() == "triton"
    monkeypatch.setattr(gk, "FORWARD_SOLVE", "gluon")
    for K in (64, 128):
        assert _rule(K, K) == "gluon", K
    refused = {
        "bf16 g (compile-checked, never run on the GPU)": dict(g=operand([256, 2, 128], bf)),
        "a TMA source off 16 bytes": dict(v=operand([256, 2, 128], bf, data_ptr=8)),
        "no flags": dict(span_flags=None),
        "G formed by stage 2 (no g)": dict(g=None),
        "K != V": dict(V=64),
        "K = 32": dict(K=32, V=32),
        "fp16 keys": dict(k=operand([256, 2, 128], torch.float16)),
        "fp32 values": dict(v=operand([256, 2, 128], f32)),
        "fp64 G": dict(G=operand([256, 2, 128], torch.float64)),
        "on the CPU": dict(G=operand([256, 2, 128], f32, is_cuda=False)),
        "strided keys": dict(k=operand([256, 2, 128], bf, contiguous=False)),
        "raw keys (tf32x3 products)": dict(keys_normalised=False),
        "fp32 W and U (not the forward's)": dict(compact=False),
    }
    for why, change in refused.items():
        assert _rule(**change) == "triton", why
    for name, value in (("NORMALISED_KEYS_PREC", "tf32"), ("NORMALISED_KEYS_DIAG_PREC", "ieee"), ("T_CHAIN", "factored")):
        with monkeypatch.context() as m:
            m.setattr(gdn_tk, name, value)
            assert _rule() == "triton", name


def test_flags_mean_what_the_triton_kernel_means():
    """Both stage-3 kernels flag a chunk at the same span (the output and backward kernels read the
    flags, whichever kernel wrote them)."""
    from tileport.ops.gdn import triton_kernels as gdn_tk
    from tileport.ops.kda import gluon_kernels as gk

    triton_span = inspect.signature(gdn_tk._solve_wu_tile_kernel.fn.fn).parameters["SPAN_MAX"].default
    assert gk.CHUNK_SPAN_MAX == triton_span


def test_gluon_forward_runs_stage3_through_the_gluon_stage(monkeypatch):
    """Plumbing: `kda_forward_gluon` hands stage 3 to `chunk_solve_wu_kda_gluon` with the flags, g
    and normalised keys; off the GPU that stage falls back to Triton's, so the output is Triton's
    forward's, bitwise, with the switch on."""
    from tileport.dispatch import interpreter_enabled
    from tileport.ops.kda import gluon_kernels as gk
    from tileport.ops.kda import triton_kernels as kk

    if not interpreter_enabled():
        pytest.skip("the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
    monkeypatch.setattr(gk, "FORWARD_SOLVE", "gluon")
    monkeypatch.setattr(gk, "chunk_output_kda_gluon", kk.chunk_output_kda)  # stage 6's Gluon kernel has no CPU fallback
    calls = []
    real = gk.chunk_solve_wu_kda_gluon
    monkeypatch.setattr(gk, "chunk_solve_wu_kda_gluon", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    torch.manual_seed(0)
    B, T, H, K = 1, 70, 1, 64
    q, k, v = (torch.randn(B, T, H, K, dtype=torch.bfloat16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K))
    beta = torch.rand(B, T, H, dtype=torch.bfloat16)
    args = (q, k, v, g, beta, K ** -0.5, torch.randn(B, H, K, K), True, True, None)
    ours, theirs = gk.kda_forward_gluon(*args), kk.kda_forward_triton(*args)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert len(calls) == 1 and calls[0]["keys_normalised"] and calls[0]["g"] is not None, calls
    assert calls[0]["span_flags"] is not None, calls
