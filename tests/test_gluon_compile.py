"""Every Gluon kernel compiles for sm_90a on a CPU-only machine and uses what it was written for.

The cases come from `compile_cases()` of each op's `gluon_kernels` module
(`tileport.compile_check.all_cases`). No GPU is needed: triton.compile runs the whole pipeline to a
cubin with the ptxas shipped in the triton wheel. Run with `-s` to see registers/spills/SMEM.
"""

from __future__ import annotations

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
