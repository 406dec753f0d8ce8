"""The LLM ops' "gluon" backends against the float64 references, forward and backward, through the
frozen gate's checker (tests/test_llm_ops_parity.py, `run_and_check`), on the shapes they accept:
- rms_norm and softmax (the forward as a persistent TMA ring over row tiles,
  tileport/gluon_rows.py; the backward below): the gate's own power-of-two rows, and rows chosen
  here for the ring's corners (one row; fewer tiles than programs; many tiles per program, with a
  ragged last tile; a tile of one row at D = 8192; a [B, T, D] input; fp32 with 4-byte elements);
  rows TMA cannot read (an unaligned row stride) run Triton's forward: checked too; softmax's
  three forward forms (FORM) on every D class their plans differ in, with its statistics and
  with -inf chunks;
- their Gluon backwards (x and dy through a paired TMA ring; rms_norm's weight gradient in
  per-program partial rows summed by a second kernel), selected by each module's BACKWARD switch
  ("gluon" by default since these cases and the A/B ran on the H200, llm_ops.md row 9):
  every D class from 64 to 8192 in each dtype, M of 1, of fewer tiles than programs and of many
  tiles per program with a ragged last one, weight None / same dtype / fp32, the weight gradient
  not wanted, strided rows (Triton's backward where TMA can't read them), each with a spy that
  sees which kernels ran;
- grouped GEMM (the forward on a persistent pipelined TMA + WGMMA kernel; the backward Triton's),
  16-bit: the gate's cases (groups of 0 and 1 rows, K and N not multiples of the tiles; those with
  rows TMA cannot read run Triton's forward), ones where the items outnumber the programs (the
  prefetch across items, K of 1 to 3 steps, groups changing from item to item, half-empty last
  column tiles), and the masked-store form kept for an A/B; the same cases on the
  warp-specialized form (WARP_SPECIALIZED, llm_ops.md row 8), which the default dispatch does not
  take yet, and a spy that sees it launched.
GPU only: on the CPU tests/test_gluon_compile.py compile-checks the kernels for sm_90a instead, and
the refusals are checked here.
"""

from __future__ import annotations

import pytest
import test_llm_ops_parity as parity  # a module import: pytest would collect imported test functions
import torch
from standins import LaunchSpy

import tileport
from tileport.ops.rms_norm.reference import rms_norm_reference
from tileport.ops.softmax.reference import softmax_reference

OPS = ("rms_norm", "softmax")
MAKERS = {"rms_norm": parity._rms_case, "softmax": parity._softmax_case}
# the gate's shapes these kernels accept, and the ring's corners
SHAPES = [(130, 64), (5, 16), (1, 128), (7, 256), (4097, 4096), (333, 8192), (2, 300, 1024), (20000, 512)]


def _accepted(shape, dtype) -> bool:
    from tileport.gluon_rows import rows_refusal

    return rows_refusal(shape[-1], dtype) is None


@pytest.mark.parametrize("dt", list(parity.DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", OPS)
def test_forward_backward(op, shape, dt, device, seed):
    parity._skip_unless_runs(op, "gluon", device)
    dtype = parity.DTYPES[dt]
    assert _accepted(shape, dtype), (op, shape, dt)
    parity.run_and_check(op, "gluon", MAKERS[op](shape, dtype, device), dtype, seed)


@pytest.mark.parametrize("weight", [None, "fp32"])
@pytest.mark.parametrize("dt", ["bf16", "fp32"])
def test_rms_norm_weight_variants(weight, dt, device, seed):
    """No weight (the kernel's HAS_WEIGHT off), and an fp32 weight beside 16-bit or fp32 rows."""
    parity._skip_unless_runs("rms_norm", "gluon", device)
    dtype = parity.DTYPES[dt]
    parity.run_and_check("rms_norm", "gluon", parity._rms_case((300, 1024), dtype, device, weight=weight), dtype, seed)


def _rows_case(op, x, device):
    if op == "rms_norm":
        w = (0.5 + torch.rand(x.shape[-1], device=device)).to(x.dtype)
        return (lambda: tileport.rms_norm(x, w)), [x, w], (lambda: rms_norm_reference(x, w))
    return (lambda: tileport.softmax(x)), [x], (lambda: softmax_reference(x))


# (buffer width, columns taken, whether TMA can read the rows): rows 512 B apart (aligned, the
# descriptor's row stride is not D), and rows 130 B apart (unaligned: Triton's forward)
STRIDED = {"aligned-stride": (256, slice(64, 128), True), "unaligned-stride": (65, slice(0, 64), False)}


@pytest.mark.parametrize("layout", list(STRIDED))
@pytest.mark.parametrize("op", OPS)
def test_strided_rows(op, layout, device, seed, monkeypatch):
    """Strided rows: aligned ones through the ring (its descriptor takes the row stride), unaligned
    ones through Triton's forward, which a spy sees called or not."""
    parity._skip_unless_runs(op, "gluon", device)
    _check_strided_rows(op, layout, "forward", device, seed, monkeypatch)


def _check_strided_rows(op, layout, stage, device, seed, monkeypatch) -> bool:
    """The gate's check of `op` on the gluon backend with the STRIDED layout's x, and that Triton's
    `stage` ("forward" or "backward") ran exactly where TMA can't read the rows; returns whether
    they were aligned."""
    import importlib

    width, cols, aligned = STRIDED[layout]
    x = torch.randn(33, width, device=device).to(torch.bfloat16)[:, cols]
    triton_kernels = importlib.import_module(f"tileport.ops.{op}.triton_kernels")
    name = f"{op}_{stage}_triton"
    calls = []
    real = getattr(triton_kernels, name)
    monkeypatch.setattr(triton_kernels, name, lambda *args: calls.append(1) or real(*args))
    parity.run_and_check(op, "gluon", _rows_case(op, x, device), torch.bfloat16, seed)
    assert bool(calls) != aligned, f"{layout}: Triton's {stage} {'ran' if calls else 'did not run'}"
    return aligned


# softmax's forward forms (gluon_kernels.FORMS, docs/perf/llm_ops.md row 7): every D class
# the plans differ in (a tile of 8 one-warp rows in a 3-deep ring of 64 KB at D = 4096 16-bit and
# 2048 fp32; one-warp rows in 32 KB tiles below; exchanges across warps above), with a ragged
# last tile (M not a multiple of BM), fewer rows than warps, and M = 1
SOFTMAX_FORM_SHAPES = [(3, 4096), (133, 4096), (1, 8192), (37, 8192), (77, 2048), (300, 1024), (1000, 64),
                       (9, 16), (130, 8)]


def _softmax_form_params():
    from tileport.gluon_rows import rows_refusal

    for shape in SOFTMAX_FORM_SHAPES:
        for dt, dtype in parity.DTYPES.items():
            if shape[-1] >= 32 // dtype.itemsize:  # D = 8 is fp32's alone (16-byte rows)
                assert rows_refusal(shape[-1], dtype) is None or "unavailable" in rows_refusal(shape[-1], dtype)
                yield pytest.param(shape, dt, id=f"{'x'.join(map(str, shape))}-{dt}")


def _check_softmax_stats(x, stats):
    """The statistics Triton's backward reads: [M, 2] fp32, (row max, 1 / sum of exp(x - max))."""
    x64 = x.detach().double().reshape(-1, x.shape[-1])
    mx = x64.max(-1).values
    assert stats.shape == (x64.shape[0], 2) and stats.dtype == torch.float32
    torch.testing.assert_close(stats[:, 0].double(), mx, rtol=0, atol=0)  # a max of fp32 values is exact
    torch.testing.assert_close(stats[:, 1].double(), 1.0 / torch.exp(x64 - mx[:, None]).sum(-1), rtol=1e-5, atol=0)


@pytest.mark.parametrize("form", ["warp_rows", "two_exchanges"])
@pytest.mark.parametrize("shape,dt", list(_softmax_form_params()))
def test_softmax_forms(form, shape, dt, device, seed, monkeypatch):
    """Each form against the float64 reference (y and the gradient through Triton's backward, which
    reads the forward's statistics), and the statistics themselves."""
    parity._skip_unless_runs("softmax", "gluon", device)
    from tileport.ops.softmax import gluon_kernels

    assert form in gluon_kernels.FORMS
    monkeypatch.setattr(gluon_kernels, "FORM", form)
    dtype = parity.DTYPES[dt]
    make = parity._softmax_case(shape, dtype, device)
    parity.run_and_check("softmax", "gluon", make, dtype, seed)
    x = make[1][0].detach()
    _check_softmax_stats(x, gluon_kernels.softmax_forward_gluon(x)[1])


@pytest.mark.parametrize("form", ["warp_rows", "two_exchanges"])
@pytest.mark.parametrize("D", [1024, 4096, 8192])
def test_softmax_extreme_logits_forms(form, D, device, seed, monkeypatch):
    """tests/test_llm_ops_parity.py's extreme rows at widths the ring takes, plus whole 256-element
    chunks of -inf before a row's finite entries."""
    parity._skip_unless_runs("softmax", "gluon", device)
    from tileport.ops.softmax import gluon_kernels

    monkeypatch.setattr(gluon_kernels, "FORM", form)
    x = 8.0 * torch.randn(6, D, device=device)
    x[1] += 1000.0
    x[3] -= 1000.0
    x[2, ::3] = float("-inf")
    x[4, 256:768] = float("-inf")
    x[5, :D - 300] = float("-inf")
    parity.run_and_check("softmax", "gluon", ((lambda: tileport.softmax(x)), [x], (lambda: softmax_reference(x))),
                         torch.float32, seed)
    y, stats = gluon_kernels.softmax_forward_gluon(x.detach())
    assert torch.isfinite(y).all()
    _check_softmax_stats(x, stats)


# Items outnumbering the programs (540 on 132 SMs), so each program's K steps run on from item to
# item: the loads of an item's first steps go out during the one before (with K of 1, 2 or 3 steps
# of 64 every prefetch of an item is the next one's), the descriptor ring turns over groups that
# change from item to item (empty, 1-row, 5-row and 77-row groups, rows ending mid-tile), the C
# descriptor clips rows past M_g, and N leaves the last column tile half or partly empty (2944 =
# 11.5 tiles: its second half wholly past N; 3000: partly); K = 160 and 1000 end in a partial step.
GG_RAGGED = (1, 200, 0, 77, 1000, 129, 5) * 3
GG_MANY_ITEMS = [(GG_RAGGED, 64, 2944), (GG_RAGGED, 96, 2944), (GG_RAGGED, 160, 3000), (GG_RAGGED, 1000, 3000)]
GG_SHAPES = (parity.CASES["grouped_gemm"][1] + parity.GPU_EXTRA["grouped_gemm"] + [((4096,) * 8, 1024, 2048)]
             + GG_MANY_ITEMS)


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", GG_SHAPES, ids=parity._shape_id)
def test_grouped_gemm(shape, dt, device, seed):
    parity._skip_unless_runs("grouped_gemm", "gluon", device)
    dtype = parity.DTYPES[dt]
    parity.run_and_check("grouped_gemm", "gluon", parity._gg_case(shape, dtype, device), dtype, seed)


@pytest.mark.parametrize("shape", [parity.CASES["grouped_gemm"][1][0], GG_MANY_ITEMS[0], GG_MANY_ITEMS[3]],
                         ids=parity._shape_id)
def test_grouped_gemm_masked_store(shape, device, seed, monkeypatch):
    """The A/B form (TMA_STORE off: the accumulator stored from registers with masks, llm_ops.md
    row 5) on the cases its epilogue differs in: tiny groups, many items per program."""
    parity._skip_unless_runs("grouped_gemm", "gluon", device)
    from tileport.ops.grouped_gemm import gluon_kernels

    monkeypatch.setattr(gluon_kernels, "TMA_STORE", False)
    parity.run_and_check("grouped_gemm", "gluon", parity._gg_case(shape, torch.bfloat16, device), torch.bfloat16,
                         seed)


def _run_warp_specialized(shape, dtype, device, seed, monkeypatch):
    from tileport.ops.grouped_gemm import gluon_kernels

    monkeypatch.setattr(gluon_kernels, "WARP_SPECIALIZED", True)
    spy = LaunchSpy(gluon_kernels._grouped_gemm_fwd_ws_kernel)
    monkeypatch.setattr(gluon_kernels, "_grouped_gemm_fwd_ws_kernel", spy)
    parity.run_and_check("grouped_gemm", "gluon", parity._gg_case(shape, dtype, device), dtype, seed)
    _rows, K, N = shape
    if K % 8 == 0 and N % 8 == 0:  # 16-byte rows: TMA reads them, so the kernel ran (else Triton's forward)
        assert spy.grids, f"{shape}: the warp-specialized kernel did not run"


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", GG_SHAPES, ids=parity._shape_id)
def test_grouped_gemm_warp_specialized(shape, dt, device, seed, monkeypatch):
    """The warp-specialized form (WARP_SPECIALIZED on: a TMA producer warp and two consumer
    warpgroups on full/empty mbarriers, llm_ops.md row 8) on every case of the default one: the
    gate's (groups of 0 and 1 rows, K and N tails), 4096-row groups, and the many-item cases
    (540 items on 132 SMs: the producer's descriptor ring and both consumers' C descriptor rings
    turn over, items of 1-3 K steps, ragged groups, half-empty last column tiles)."""
    parity._skip_unless_runs("grouped_gemm", "gluon", device)
    _run_warp_specialized(shape, parity.DTYPES[dt], device, seed, monkeypatch)


@pytest.mark.parametrize("shape", [parity.CASES["grouped_gemm"][1][0], GG_MANY_ITEMS[0], GG_MANY_ITEMS[3]],
                         ids=parity._shape_id)
def test_grouped_gemm_warp_specialized_masked_store(shape, device, seed, monkeypatch):
    """The warp-specialized form with the masked register store (TMA_STORE off): each consumer
    warpgroup stores its 64 rows with a row mask."""
    parity._skip_unless_runs("grouped_gemm", "gluon", device)
    from tileport.ops.grouped_gemm import gluon_kernels

    monkeypatch.setattr(gluon_kernels, "TMA_STORE", False)
    _run_warp_specialized(shape, torch.bfloat16, device, seed, monkeypatch)


# ------------------------------------------------------------------------------------------------
# The Gluon backwards (BACKWARD = "gluon"; docs/perf/llm_ops.md row 9)
# ------------------------------------------------------------------------------------------------
BWD_DS = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]  # each with the dtypes the ring takes it in


def _bwd_rows(D: int) -> list[int]:
    """M = 1; 37 (fewer tiles than programs at every D: one to 37); and about 10 tiles a program on
    132 SMs at 16-bit (20 at fp32), odd, so the last tile is ragged wherever a tile holds more than
    one row and each program's ring wraps its phases more than once."""
    return [1, 37, 10 * 132 * max(1, 16384 // (2 * D)) + 3]


def _bwd_params():
    from tileport.gluon_rows import rows_refusal

    for D in BWD_DS:
        for M in _bwd_rows(D):
            for dt in parity.DTYPES:
                if rows_refusal(D, parity.DTYPES[dt]) is None:  # the narrow rows: 16-bit from 16, fp32 from 8
                    yield pytest.param((M, D), dt, id=f"{M}x{D}-{dt}")


def _gluon_backward_on(op, monkeypatch):
    """Select the Gluon backward of `op` and spy on its kernels' launches: {kernel name: spy}."""
    import importlib

    from tileport import gluon_rows

    gk = importlib.import_module(f"tileport.ops.{op}.gluon_kernels")
    assert "gluon" in gk.BACKWARDS
    monkeypatch.setattr(gk, "BACKWARD", "gluon")
    spies = {"bwd": LaunchSpy(getattr(gk, f"_{op}_bwd_kernel"))}
    monkeypatch.setattr(gk, f"_{op}_bwd_kernel", spies["bwd"])
    spies["sum"] = LaunchSpy(gluon_rows._sum_partial_rows_kernel)
    monkeypatch.setattr(gluon_rows, "_sum_partial_rows_kernel", spies["sum"])
    return spies


@pytest.mark.parametrize("shape,dt", list(_bwd_params()))
@pytest.mark.parametrize("op", OPS)
def test_gluon_backward(op, shape, dt, device, seed, monkeypatch):
    """The Gluon backward (forward on the gluon backend too) against the float64 reference: dx, and
    rms_norm's weight gradient (a weight in x's dtype)."""
    parity._skip_unless_runs(op, "gluon", device)
    dtype = parity.DTYPES[dt]
    spies = _gluon_backward_on(op, monkeypatch)
    parity.run_and_check(op, "gluon", MAKERS[op](shape, dtype, device), dtype, seed)
    assert len(spies["bwd"].grids) == 1, f"{op} {shape}: the Gluon backward kernel ran {len(spies['bwd'].grids)} times"
    assert len(spies["sum"].grids) == (op == "rms_norm"), "the weight gradient's sum of partial rows"


@pytest.mark.parametrize("weight", [None, "fp32", "same"])
@pytest.mark.parametrize("shape", [(37, 1024), (20003, 1024), (531, 4096), (267, 8192)], ids=parity._shape_id)
@pytest.mark.parametrize("dt", list(parity.DTYPES))
def test_rms_norm_gluon_backward_weights(weight, shape, dt, device, seed, monkeypatch):
    """No weight (HAS_WEIGHT and the weight gradient off: no second kernel), an fp32 weight beside
    16-bit rows (dw summed into fp32), and one in x's dtype."""
    parity._skip_unless_runs("rms_norm", "gluon", device)
    dtype = parity.DTYPES[dt]
    spies = _gluon_backward_on("rms_norm", monkeypatch)
    parity.run_and_check("rms_norm", "gluon", parity._rms_case(shape, dtype, device, weight=weight), dtype, seed)
    assert len(spies["bwd"].grids) == 1
    assert len(spies["sum"].grids) == (weight is not None)


@pytest.mark.parametrize("dt", list(parity.DTYPES))
def test_rms_norm_gluon_backward_without_dw(dt, device, seed, monkeypatch):
    """The stage function with want_dw False (a frozen weight): no weight gradient, no second kernel,
    dx as with it, against the float64 reference."""
    parity._skip_unless_runs("rms_norm", "gluon", device)
    from tileport.ops.rms_norm import gluon_kernels
    from tileport.testing import check

    from tileport.testing import poisoned

    dtype = parity.DTYPES[dt]
    spies = _gluon_backward_on("rms_norm", monkeypatch)
    torch.manual_seed(seed)
    x = torch.randn(1003, 2048, device=device).to(dtype)
    w = (0.5 + torch.rand(2048, device=device)).to(dtype)
    dy = torch.randn_like(x)
    with poisoned():  # an unwritten row of dx is NaN
        dx, dw = gluon_kernels.rms_norm_backward_gluon(dy, x, w, 1e-5, False)
    assert dw is None and len(spies["sum"].grids) == 0 and len(spies["bwd"].grids) == 1
    x64 = x.double().requires_grad_(True)
    (ref_dx,) = torch.autograd.grad(rms_norm_reference(x64, w.double(), 1e-5), x64, dy.double())
    check("dx without dw", dx, ref_dx, dtype)


@pytest.mark.parametrize("layout", list(STRIDED))
@pytest.mark.parametrize("op", OPS)
def test_gluon_backward_strided_rows(op, layout, device, seed, monkeypatch):
    """Strided x with the Gluon backward on: aligned rows through the paired ring (its descriptors
    take each input's row stride), unaligned ones through Triton's backward (a spy on each)."""
    parity._skip_unless_runs(op, "gluon", device)
    spies = _gluon_backward_on(op, monkeypatch)
    aligned = _check_strided_rows(op, layout, "backward", device, seed, monkeypatch)
    assert bool(spies["bwd"].grids) == aligned, f"{layout}: the Gluon backward {'ran' if spies['bwd'].grids else 'did not run'}"


def test_gluon_backward_is_the_default():
    """The H200 gated and timed the Gluon backwards (docs/perf/llm_ops.md row 9): the gluon
    backends run them unless told otherwise."""
    from tileport.ops.rms_norm import gluon_kernels as rms
    from tileport.ops.softmax import gluon_kernels as sm

    assert rms.BACKWARD == "gluon" and sm.BACKWARD == "gluon"


def test_refusals_name_the_reason():
    from tileport.ops.rms_norm import DISPATCHER as RMS
    from tileport.ops.rms_norm import RMSNormCall
    from tileport.ops.softmax import DISPATCHER as SOFTMAX
    from tileport.ops.softmax import explain_call as softmax_call

    rms = RMS._by_name["gluon"].refusal
    assert rms(RMSNormCall(4096, torch.bfloat16, torch.bfloat16, "cuda", (9, 0))) is None
    assert "powers of two" in rms(RMSNormCall(5120, torch.bfloat16, torch.bfloat16, "cuda", (9, 0)))
    assert "powers of two" in rms(RMSNormCall(16384, torch.bfloat16, None, "cuda", (9, 0)))
    assert "powers of two" in rms(RMSNormCall(8, torch.bfloat16, None, "cuda", (9, 0)))
    assert "Hopper" in rms(RMSNormCall(4096, torch.bfloat16, None, "cuda", (8, 0)))
    sm = SOFTMAX._by_name["gluon"].refusal
    assert sm(softmax_call("8192,4096", torch.float32, "cuda", (9, 0))) is None
    assert "powers of two" in sm(softmax_call("8192,200", torch.float32, "cuda", (9, 0)))
    from tileport.ops.grouped_gemm import DISPATCHER as GG
    from tileport.ops.grouped_gemm import GroupedGemmCall

    gg = GG._by_name["gluon"].refusal
    assert gg(GroupedGemmCall(4096, 4096, torch.bfloat16, torch.bfloat16, "cuda", (9, 0))) is None
    assert "full fp32" in gg(GroupedGemmCall(4096, 4096, torch.float32, torch.float32, "cuda", (9, 0)))
    assert "differs" in gg(GroupedGemmCall(4096, 4096, torch.bfloat16, torch.float16, "cuda", (9, 0)))


@pytest.mark.parametrize("shape", [(37, 4096), (2643, 4096), (1323, 8192), (5, 16)], ids=parity._shape_id)
@pytest.mark.parametrize("dt", list(parity.DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_gluon_backward_rows_match_triton(op, shape, dt, device, seed, monkeypatch):
    """Row by row against Triton's backward on the same inputs (one wrong or half-landed tile is a
    few rows among thousands: the whole-tensor error against the reference hardly moves), and
    rms_norm's dw the same in two runs (a fixed order of partial sums)."""
    import importlib

    from tileport.testing import poisoned

    parity._skip_unless_runs(op, "gluon", device)
    dtype = parity.DTYPES[dt]
    gk = importlib.import_module(f"tileport.ops.{op}.gluon_kernels")
    tk = importlib.import_module(f"tileport.ops.{op}.triton_kernels")
    torch.manual_seed(seed)
    M, D = shape
    x = torch.randn(M, D, device=device).to(dtype)
    dy = torch.randn(M, D, device=device).to(dtype)
    if op == "rms_norm":
        w = (0.5 + torch.rand(D, device=device)).to(dtype)
        args = (dy, x, w, 1e-5, True)
    else:
        args = (dy, x, tk.softmax_forward_triton(x)[1])
    with poisoned():
        ref = getattr(tk, f"{op}_backward_triton")(*args)
        spies = _gluon_backward_on(op, monkeypatch)
        out = getattr(gk, f"{op}_backward_gluon")(*args)
        again = getattr(gk, f"{op}_backward_gluon")(*args)
    assert len(spies["bwd"].grids) == 2
    dx, ref_dx = (out[0], ref[0]) if op == "rms_norm" else (out, ref)
    rows = (dx.double() - ref_dx.double()).norm(dim=1) / ref_dx.double().norm(dim=1).clamp_min(1e-30)
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.isfinite(dx).all() and float(rows.max()) <= bound, (op, shape, dt, float(rows.max()), int(rows.argmax()))
    if op == "rms_norm":
        assert torch.equal(out[1], again[1]), "dw differs between two runs"
        check_rel = float((out[1].double() - ref[1].double()).norm() / ref[1].double().norm())
        assert check_rel <= bound, check_rel



@pytest.mark.parametrize("shape", [(37, 4096), (2643, 4096), (1323, 8192), (5, 16), (20003, 1024)],
                         ids=parity._shape_id)
@pytest.mark.parametrize("dt", list(parity.DTYPES))
def test_softmax_backward_stats_forms(shape, dt, device, seed, monkeypatch):
    """softmax's Gluon backward with its row statistics loaded in the tile's own step ("in_loop") or
    a step ahead ("ahead", docs/perf/llm_ops.md row 11): the same values, the same arithmetic, so dx
    bitwise equal (ragged last tiles and programs with one tile among the shapes); "auto" launches
    "ahead" where a tile holds more than one row, and "in_loop" where it holds one."""
    from tileport.gluon_rows import pair_stream_plan
    from tileport.ops.softmax import gluon_kernels as gk
    from tileport.ops.softmax import triton_kernels as tk
    from tileport.testing import poisoned

    parity._skip_unless_runs("softmax", "gluon", device)
    dtype = parity.DTYPES[dt]
    torch.manual_seed(seed)
    x = torch.randn(*shape, device=device).to(dtype)
    dy = torch.randn(*shape, device=device).to(dtype)
    stats = tk.softmax_forward_triton(x)[1]
    spies = _gluon_backward_on("softmax", monkeypatch)
    got = {}
    for form in gk.BACKWARD_STATS_FORMS:
        monkeypatch.setattr(gk, "BACKWARD_STATS", form)
        with poisoned():
            got[form] = gk.softmax_backward_gluon(dy, x, stats)
    ahead = [kw["STATS_AHEAD"] for kw in spies["bwd"].kwargs]
    rows_a_tile = pair_stream_plan(x, dy).a_desc.block_shape[0]
    assert ahead == [rows_a_tile > 1, False, True], (shape, dt, rows_a_tile, ahead)
    assert torch.isfinite(got["in_loop"]).all()
    for form in ("auto", "ahead"):
        assert torch.equal(got[form], got["in_loop"]), f"{shape} {dt}: dx with BACKWARD_STATS {form!r} != 'in_loop'"


def test_softmax_backward_stats_switch_is_checked(monkeypatch):
    """An unknown BACKWARD_STATS is a ValueError naming the switch and its forms, before any launch."""
    from tileport.ops.softmax import gluon_kernels as gk

    monkeypatch.setattr(gk, "BACKWARD_STATS", "early")
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="BACKWARD_STATS 'early' is not one of .*'auto', 'in_loop', 'ahead'"):
        gk.softmax_backward_gluon(x, x, torch.zeros(4, 2))


@pytest.mark.parametrize("op", OPS)
def test_forward_ctas_per_sm_switch_is_checked(op, monkeypatch):
    """An unknown FORWARD_CTAS_PER_SM (docs/perf/llm_ops.md row 12) is a ValueError naming the switch
    and its forms, before any launch."""
    import importlib

    gk = importlib.import_module(f"tileport.ops.{op}.gluon_kernels")
    monkeypatch.setattr(gk, "FORWARD_CTAS_PER_SM", 3)
    x = torch.randn(4, 64)
    call = (lambda: gk.rms_norm_forward_gluon(x, None, 1e-6)) if op == "rms_norm" else (lambda: gk.softmax_forward_gluon(x))
    with pytest.raises(ValueError, match=r"FORWARD_CTAS_PER_SM 3 is not one of \(1, 2\)"):
        call()
