"""`tileport lint`: every rule flags a small bad kernel and passes its fixed twin; suppressions; the CLI.

The kernels are source strings: the checker only parses them (nothing here needs a GPU or triton)."""

import subprocess
import sys
import textwrap

import pytest

from tileport import lint

TRITON = """
import triton
import triton.language as tl
"""

GLUON = """
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
"""


def run(src: str, header: str = ""):
    return lint.lint_source(textwrap.dedent(header) + textwrap.dedent(src), "k.py")


def active(findings, rule=None):
    return [f for f in findings if f.suppressed is None and (rule is None or f.rule == rule)]


def line_of(src_with_header: str, needle: str) -> int:
    for i, text in enumerate(textwrap.dedent(src_with_header).splitlines(), 1):
        if needle in text:
            return i
    raise AssertionError(needle)


# ---------------------------------------------------------------------------------------------
# TP001: 2D tiles through raw pointers
# ---------------------------------------------------------------------------------------------
GLUON_2D_LOAD = """
@gluon.jit
def k(x_ptr, y_ptr, N, BM: gl.constexpr, BN: gl.constexpr, BL: gl.constexpr):
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, BL))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, BL))
    offs = rows[:, None] * N + cols[None, :]
    x = gl.load(x_ptr + offs, mask=rows[:, None] < N)
    gl.store(y_ptr + rows, gl.sum(x, axis=1))
"""


def test_tp001_gluon_2d_load_flagged_1d_store_not():
    fs = active(run(GLUON_2D_LOAD, GLUON), "TP001")
    assert [f.line for f in fs] == [line_of(GLUON + GLUON_2D_LOAD, "x = gl.load")]
    assert "mask" in fs[0].message and "async_copy_global_to_shared" in fs[0].message


def test_tp001_triton_through_helper_reported_at_call_site():
    src = """
    @triton.jit
    def _ld(ptrs, mask):
        return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def k(x_ptr, y_ptr, N, BM: tl.constexpr, BN: tl.constexpr):
        rows = tl.arange(0, BM)
        cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BN), BN), BN)
        offs = rows[:, None] * N + cols[None, :]
        x = _ld(x_ptr + offs, rows[:, None] < N)
        tl.store(y_ptr + rows, tl.sum(x, 1))
    """
    fs = active(run(src, TRITON))
    assert [(f.rule, f.line) for f in fs] == [("TP001", line_of(TRITON + src, "x = _ld("))]
    assert "_ld" in fs[0].message


def test_tp001_clean_1d_and_descriptor_kernels():
    src = """
    @triton.jit
    def k1(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.multiple_of(tl.program_id(0) * BLOCK, BLOCK) + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs) * 2)

    @triton.jit
    def k2(x_ptr, y_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
        desc = tl.make_tensor_descriptor(x_ptr, [M, N], [N, 1], [BM, BN])
        t = desc.load([0, 0])
        rows = tl.arange(0, BM)
        cols = tl.arange(0, BN)
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], t)  # a kernel with descriptors chose this
    """
    assert active(run(src, TRITON)) == []


def test_tp001_cp_async_and_autotuned_kernel():
    src = """
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    @gluon.jit
    def k(x_ptr, N, BM: gl.constexpr, BN: gl.constexpr, BL: gl.constexpr, SL: gl.constexpr):
        smem = gl.allocate_shared_memory(gl.float16, [BM, BN], SL)
        rows = gl.arange(0, BM, layout=gl.SliceLayout(1, BL))
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, BL))
        async_copy.async_copy_global_to_shared(smem, x_ptr + rows[:, None] * N + cols[None, :])
        async_copy.commit_group()
    """
    fs = active(run(src, GLUON))
    assert [(f.rule, f.line) for f in fs] == [("TP001", line_of(GLUON + src, "async_copy.async_copy_global"))]

    tuned = """
    @triton.autotune(configs=[triton.Config({}, num_warps=8)], key=["N"])
    @triton.jit
    def k(x_ptr, N, BM: tl.constexpr, BN: tl.constexpr):
        rows = tl.arange(0, BM)
        cols = tl.arange(0, BN)
        x = tl.load(x_ptr + tl.expand_dims(rows, 1) * N + tl.expand_dims(cols, 0))
        tl.store(x_ptr + rows, tl.sum(x, 1))
    """
    fs = active(run(tuned, TRITON))
    assert sorted((f.rule, f.line) for f in fs) == [("TP001", line_of(TRITON + tuned, "x = tl.load")),
                                                    ("TP007", line_of(TRITON + tuned, "def k("))]


# ---------------------------------------------------------------------------------------------
# TP002: .store() to shared memory, then TMA store / WGMMA, without a fence
# ---------------------------------------------------------------------------------------------
TMA_STORE = """
@gluon.jit
def k(desc, x_ptr, BM: gl.constexpr, BL: gl.constexpr):
    smem = gl.allocate_shared_memory(desc.dtype, desc.block_type.shape, desc.layout)
    smem.store(gl.load(x_ptr + gl.arange(0, BM, layout=BL)))
    {fence}
    tma.async_copy_shared_to_global(desc, [0, 0], smem)
    tma.store_wait(0)
"""


def test_tp002_missing_fence_before_tma_store():
    src = TMA_STORE.format(fence="pass")
    fs = active(run(src, GLUON))
    assert [(f.rule, f.line) for f in fs] == [("TP002", line_of(GLUON + src, "async_copy_shared_to_global"))]


def test_tp002_fence_present_is_clean():
    assert active(run(TMA_STORE.format(fence="fence_async_shared()"), GLUON)) == []


WGMMA_LOOP = """
@gluon.jit
def k(a_ptr, b_smem, acc, n, BL: gl.constexpr, SL: gl.constexpr):
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 64], SL)
    for i in range(n):
        acc = warpgroup_mma(a_smem.index(0), b_smem, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()
        a_smem.store(gl.load(a_ptr + i))
        {fence}
"""


def test_tp002_loop_carried_store_then_wgmma():
    src = WGMMA_LOOP.format(fence="")
    fs = active(run(src, GLUON))
    assert [(f.rule, f.line) for f in fs] == [("TP002", line_of(GLUON + src, "warpgroup_mma(a_smem"))]
    assert active(run(WGMMA_LOOP.format(fence="fence_async_shared()"), GLUON)) == []


# ---------------------------------------------------------------------------------------------
# TP003: warpgroup_mma_wait result dropped
# ---------------------------------------------------------------------------------------------
WAIT = """
@gluon.jit
def k(a_smem, b_smem, acc, o_ptr, BL: gl.constexpr):
    acc = warpgroup_mma(a_smem, b_smem, acc, is_async=True)
    {wait}
    gl.store(o_ptr + gl.arange(0, 64, layout=BL), gl.sum(acc, axis=1))
"""


def test_tp003_dropped_wait_result():
    for wait in ("warpgroup_mma_wait(0, deps=[acc])", "_unused = warpgroup_mma_wait(0, deps=[acc])"):
        src = WAIT.format(wait=wait)
        fs = active(run(src, GLUON))
        assert [(f.rule, f.line) for f in fs] == [("TP003", line_of(GLUON + src, "warpgroup_mma_wait("))], wait


def test_tp003_used_wait_result_is_clean():
    assert active(run(WAIT.format(wait="acc = warpgroup_mma_wait(0, deps=[acc])"), GLUON)) == []


# ---------------------------------------------------------------------------------------------
# TP004: mbarrier init without invalidate; one barrier for TMA and MMA completion
# ---------------------------------------------------------------------------------------------
BARRIERS = """
@gluon.jit
def _load(desc, smem, bars, i):
    mbarrier.expect(bars.index(i), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [i * 64, 0], bars.index(i), smem.index(i))

@gluon.jit
def k(desc, b_smem, acc, o_ptr, BL: gl.constexpr):
    smem = gl.allocate_shared_memory(desc.dtype, [2, 64, 64], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(done.index(i), count=1)
    fence_async_shared()
    _load(desc, smem, ready, 0)
    mbarrier.wait(ready.index(0), 0)
    acc = warpgroup_mma(smem.index(0), b_smem, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive({mma_bar}.index(0))
    gl.store(o_ptr + gl.arange(0, 64, layout=BL), gl.sum(acc, axis=1))
    for i in gl.static_range(2):
        mbarrier.invalidate(ready.index(i))
        {inval_done}
"""


def test_tp004_clean_barriers():
    src = BARRIERS.format(mma_bar="done", inval_done="mbarrier.invalidate(done.index(i))")
    assert active(run(src, GLUON)) == []


def test_tp004_init_without_invalidate():
    src = BARRIERS.format(mma_bar="done", inval_done="pass")
    fs = active(run(src, GLUON))
    assert [(f.rule, f.line) for f in fs] == [("TP004", line_of(GLUON + src, "mbarrier.init(done"))]
    assert "`done`" in fs[0].message


def test_tp004_barrier_shared_by_tma_and_mma():
    # the TMA use is inside the helper: the parameter `bars` is bound to the kernel's `ready`
    src = BARRIERS.format(mma_bar="ready", inval_done="mbarrier.invalidate(done.index(i))")
    fs = active(run(src, GLUON))
    assert [(f.rule, f.line) for f in fs] == [("TP004", line_of(GLUON + src, "mbarrier.arrive(ready"))]
    assert "TMA" in fs[0].message and "MMA" in fs[0].message


# ---------------------------------------------------------------------------------------------
# TP005: refill of a WGMMA operand right after warpgroup_mma_wait (triton 3.6, issue 11047)
# ---------------------------------------------------------------------------------------------
RACE = """
@gluon.jit
def k(a_desc, b_smem, acc, n, o_ptr, BL: gl.constexpr):
    a = gl.allocate_shared_memory(a_desc.dtype, [2, 64, 64], a_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(bar.index(s), count=1)
    for i in range(n):
        s = i % 2
        mbarrier.wait(bar.index(s), (i // 2) & 1)
        acc = warpgroup_mma(a.index(s), b_smem, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        {barrier}
        mbarrier.expect(bar.index(s), a_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [(i + 2) * 64, 0], bar.index(s), a.index(s))
    gl.store(o_ptr + gl.arange(0, 64, layout=BL), gl.sum(acc, axis=1))
    for s in gl.static_range(2):
        mbarrier.invalidate(bar.index(s))

def launch(a_desc, b, acc, n, o):
    k[(1,)](a_desc, b, acc, n, o, BL=None, num_warps={warps})
"""


def test_tp005_refill_after_wait_without_barrier():
    src = RACE.format(barrier="pass", warps=8)
    fs = active(run(src, GLUON))
    assert [(f.rule, f.line) for f in fs] == [("TP005", line_of(GLUON + src, "tma.async_copy_global_to_shared"))]


def test_tp005_clean_with_thread_barrier_or_four_warps():
    assert active(run(RACE.format(barrier="gl.thread_barrier()", warps=8), GLUON)) == []
    assert active(run(RACE.format(barrier="pass", warps=4), GLUON)) == []


def test_tp005_unknown_warps_is_flagged():
    src = RACE.format(barrier="pass", warps="cfg.num_warps")
    assert [f.rule for f in active(run(src, GLUON))] == ["TP005"]


# ---------------------------------------------------------------------------------------------
# TP006: module-level globals read in a kernel
# ---------------------------------------------------------------------------------------------
GLOBALS = """
SCALE = 0.5
HALF = tl.constexpr(0.5)
ANNOT: tl.constexpr = 0.5
F32 = tl.float32

@triton.jit
def _helper(x):
    return x

@triton.jit
def k(x_ptr, BLOCK: tl.constexpr):
    offs = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), BLOCK), BLOCK)
    x = tl.load(x_ptr + offs).to(F32)
    tl.store(x_ptr + offs, _helper(x) * {name})
"""


def test_tp006_plain_global_flagged():
    src = GLOBALS.format(name="SCALE")
    fs = active(run(src, TRITON))
    assert [(f.rule, f.line) for f in fs] == [("TP006", line_of(TRITON + src, "tl.store(x_ptr"))]
    assert "`SCALE`" in fs[0].message


def test_tp006_annotated_constexpr_global_flagged():
    # triton 3.6 rejects `X: tl.constexpr = v` read from a kernel (only `X = tl.constexpr(v)` works)
    fs = active(run(GLOBALS.format(name="ANNOT"), TRITON))
    assert [f.rule for f in fs] == ["TP006"] and "tl.constexpr(" in fs[0].message


def test_tp006_constexpr_global_and_functions_clean():
    assert active(run(GLOBALS.format(name="HALF"), TRITON)) == []


# ---------------------------------------------------------------------------------------------
# TP007: Triton kernels without alignment hints
# ---------------------------------------------------------------------------------------------
HINTS = """
@triton.jit
def _twice(x_ptr, offs):
    return tl.load(x_ptr + offs) * 2

@triton.jit
def k(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = {offs}
    tl.store(y_ptr + offs, _twice(x_ptr, offs))
"""


def test_tp007_no_hints_flagged_once_on_def():
    src = HINTS.format(offs="tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)")
    fs = active(run(src, TRITON))
    assert [(f.rule, f.line) for f in fs] == [("TP007", line_of(TRITON + src, "def k("))]
    assert "x_ptr, y_ptr" in fs[0].message  # the helper is not flagged on its own


def test_tp007_hints_clean():
    src = HINTS.format(offs="tl.multiple_of(tl.program_id(0) * BLOCK, BLOCK) + tl.arange(0, BLOCK)")
    assert active(run(src, TRITON)) == []


# ---------------------------------------------------------------------------------------------
# suppressions
# ---------------------------------------------------------------------------------------------
def test_suppression_with_reason():
    src = GLUON_2D_LOAD.replace("x = gl.load(x_ptr + offs, mask=rows[:, None] < N)",
                                "x = gl.load(x_ptr + offs, mask=rows[:, None] < N)  # lint: allow TP001 -- gather")
    fs = run(src, GLUON)
    assert active(fs) == []
    assert [(f.rule, f.suppressed) for f in fs] == [("TP001", "gather")]


def test_suppression_on_line_above_and_whole_function():
    above = GLUON_2D_LOAD.replace("    x = gl.load",
                                  "    # lint: allow TP001 -- one tile, not worth TMA\n    x = gl.load")
    assert active(run(above, GLUON)) == []
    func = GLUON_2D_LOAD.replace("@gluon.jit", "@gluon.jit  # lint: allow-function TP001 -- tiny tiles")
    assert active(run(func, GLUON)) == []
    wrong_rule = GLUON_2D_LOAD.replace("    x = gl.load", "    # lint: allow TP007 -- not this rule\n    x = gl.load")
    assert [f.rule for f in active(run(wrong_rule, GLUON))] == ["TP001"]


def test_suppression_without_reason_is_a_finding():
    src = GLUON_2D_LOAD.replace("    x = gl.load", "    # lint: allow TP001\n    x = gl.load")
    fs = active(run(src, GLUON))
    assert sorted(f.rule for f in fs) == ["TP000", "TP001"]  # suppresses nothing, and is reported
    bad = [f for f in fs if f.rule == "TP000"][0]
    assert bad.line == line_of(GLUON + src, "# lint: allow TP001")


def test_suppression_unknown_rule_and_malformed():
    fs = active(run("x = 1  # lint: allow TP999 -- nope\ny = 2  # lint: alow TP001 -- typo\n"))
    assert [(f.rule, f.line) for f in fs] == [("TP000", 1), ("TP000", 2)]


# ---------------------------------------------------------------------------------------------
# output and CLI
# ---------------------------------------------------------------------------------------------
def test_finding_format_one_line():
    f = active(run(GLUON_2D_LOAD, GLUON))[0]
    text = f.format()
    assert text.startswith(f"k.py:{f.line}: TP001 ") and " \u2014 " in text and "\n" not in text


def test_cli_exit_codes(tmp_path, capsys):
    clean = tmp_path / "clean.py"
    clean.write_text(textwrap.dedent(TRITON) + textwrap.dedent(
        HINTS.format(offs="tl.multiple_of(tl.program_id(0) * BLOCK, BLOCK) + tl.arange(0, BLOCK)")))
    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent(GLUON) + textwrap.dedent(GLUON_2D_LOAD))
    assert lint.main([str(clean)]) == 0
    assert lint.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "bad.py:" in out and "TP001" in out and "clean.py" not in out

    suppressed = tmp_path / "sup" / "k.py"
    suppressed.parent.mkdir()
    suppressed.write_text(bad.read_text().replace("mask=rows[:, None] < N)", "mask=rows[:, None] < N)  # lint: allow "
                                                                             "TP001 -- tested"))
    assert lint.main([str(suppressed)]) == 0
    assert capsys.readouterr().out == ""
    assert lint.main([str(suppressed), "--show-suppressed"]) == 0
    assert "[suppressed: tested]" in capsys.readouterr().out

    assert lint.main([str(tmp_path / "missing.py")]) == 2
    broken = tmp_path / "broken" / "x.py"
    broken.parent.mkdir()
    broken.write_text("def (:\n")
    assert lint.main([str(broken)]) == 2


def test_tileport_cli_dispatches_lint(tmp_path, capsys):
    from tileport import cli

    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent(GLUON) + textwrap.dedent(GLUON_2D_LOAD))
    assert cli.main(["lint", str(bad)]) == 1
    assert "TP001" in capsys.readouterr().out
    assert cli.main(["lint", "--list-rules"]) == 0
    # default paths: the installed tileport/ops (what the lead will fix or suppress)
    assert cli.main(["lint"]) in (0, 1)


@pytest.mark.parametrize("rule", sorted(lint.RULES))
def test_every_rule_documented(rule):
    title, why = lint.RULES[rule]
    assert title and why and "\n" not in why


def test_project_kernels_are_lint_clean():
    """CI gate: every finding on tileport's own kernels is fixed or suppressed with a reason."""
    import os

    import tileport

    ops = os.path.join(os.path.dirname(tileport.__file__), "ops")
    proc = subprocess.run([sys.executable, "-m", "tileport", "lint", ops], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
