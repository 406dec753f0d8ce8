"""Every Gluon kernel compiles for sm_90a on a CPU-only machine and uses what it was written for.

The cases come from `compile_cases()` of each op's `gluon_kernels` module
(`tileport.compile_check.all_cases`). No GPU is needed: triton.compile runs the whole pipeline to a
cubin with the ptxas shipped in the triton wheel. Run with `-s` to see registers/spills/SMEM.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton.experimental.gluon")

from tileport.compile_check import all_cases, compile_case, loop_barriers  # noqa: E402

CASES = all_cases()
SMEM_LIMIT = 227 * 1024  # Hopper: max dynamic shared memory per CTA


def test_cases_found():
    names = [c.name for c in CASES]
    assert any(n.startswith("attnres_fwd") for n in names), names
    assert any(n.startswith("attnres_bwd") for n in names), names
    assert len(set(names)) == len(names), "case names must be unique"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gluon_kernel_compiles_for_sm90a(case):
    report = compile_case(case)
    print(f"\n{report.summary()}")
    assert report.target_line is not None and "sm_90a" in report.target_line, report.target_line
    assert not report.missing_ptx, f"{case.name}: PTX lacks {report.missing_ptx}"
    if report.shared is not None:
        limit = SMEM_LIMIT if case.expect_max_shared is None else case.expect_max_shared
        assert report.shared <= limit, f"{case.name}: {report.shared} bytes of SMEM (limit {limit})"
    if case.expect_max_spills is not None and report.n_spills is not None:
        assert report.n_spills <= case.expect_max_spills, (
            f"{case.name}: {report.n_spills} bytes of spill stores ({report.n_regs} registers)")
    if case.expect_loop_barriers is not None:
        counts = loop_barriers(report.ptx)
        assert counts == [case.expect_loop_barriers], (
            f"{case.name}: CTA barriers per outer-loop iteration {counts}, expected [{case.expect_loop_barriers}]")


def _ptx_loops(ptx: str) -> list[str]:
    """The PTX's single-block loops: the text from a basic-block label ($L__BB...:) to the next,
    kept when it branches back to its own label (an inline asm's local labels, such as the mbarrier
    waits' `waitLoop:`, do not cut). A K loop without branches inside it is one of them."""
    parts = re.split(r"^(\$L__BB\d+_\d+):", ptx, flags=re.M)
    return [body for label, body in zip(parts[1::2], parts[2::2]) if re.search(rf"bra(\.uni)?\s+{re.escape(label)};", body)]


def test_grouped_gemm_ws_k_loops_meet_at_no_cta_barrier():
    """The warp-specialized grouped GEMM forward (llm_ops.md row 8) has the structure it was written
    for: registers moved by setmaxnreg (producer down to WS_PRODUCER_REGS, consumers up to
    WS_CONSUMER_REGS); the producer's K loop (mbarrier wait, expect, TMA loads) has no barrier at
    all; each consumer's K loop (mbarrier wait, WGMMAs, wait_group 1, arrive) has no CTA-wide
    barrier, only at most two 128-thread named barriers of its own warpgroup (Triton 3.6's
    membar analysis puts them around the mbarrier wait and arrive: it cannot tell the ready and
    empty barriers apart inside a partition). The single-partition kernel has four CTA-wide
    barriers (256 threads) per K step."""
    from tileport.ops.grouped_gemm import gluon_kernels as gg

    report = compile_case(next(c for c in CASES if c.name == "grouped_gemm_fwd_ws_bfloat16"))
    moves = set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", report.ptx))
    assert ("dec", str(gg.WS_PRODUCER_REGS)) in moves and ("inc", str(gg.WS_CONSUMER_REGS)) in moves, moves
    loops = _ptx_loops(report.ptx)
    load = "cp.async.bulk.tensor.2d.shared::cluster.global"
    producer = [b for b in loops if load in b]
    consumer = [b for b in loops if "wgmma.mma_async" in b]
    # one producer loop; one K loop per consumer warpgroup (the default partition and the worker)
    assert len(producer) == 1 and len(consumer) == 2, (len(producer), len(consumer))
    for body in producer:
        assert "bar.sync" not in body and "barrier.sync" not in body and "mbarrier.try_wait" in body, body
    for body in consumer:
        assert "barrier.sync" not in body and load not in body, body
        named = re.findall(r"bar\.sync\s+\d+(?:,\s*(\d+))?;", body)
        assert len(named) <= 2 and all(n == "128" for n in named), named
        assert "wgmma.wait_group.sync.aligned 1;" in body, body
        assert "mbarrier.arrive.shared" in body and "mbarrier.try_wait" in body, body
