"""Every autotune candidate of rms_norm's Triton backward computes the same thing, and the weight
gradient's partial rows are summed in a fixed order.

On a GPU the autotuner may pick any candidate of `BWD_OPTIONS` (row tile, pipeline depth, programs
per SM, warps) that fits the call's row width and dtype (`candidate_fits`); under the interpreter
`tuned` keeps only the first of `INTERPRETER_BWD_OPTIONS`. Here each GPU candidate in turn is made
the kernel's only config, and the parity gate's rms_norm shapes (tests/test_llm_ops_parity.py,
called through its `run_and_check`: poisoned buffers, the gate's bounds) run forward and backward
against the float64 reference, with two shapes added where a program walks several row tiles and
the last tile is ragged; then the chunked (wide-row) path and the raw-pointer path.
"""

from __future__ import annotations

import pytest
import test_llm_ops_parity as parity  # a module import: pytest would collect imported test functions
import torch

from tileport.testing import check, on_gpu, poisoned

tk = pytest.importorskip("tileport.ops.rms_norm.triton_kernels")

# (300, 200): 10 or 19 row tiles (32 or 16 rows of 256 columns) on the interpreter's 2 programs,
# the last one ragged; (2, 150, 96): 3D, 300 rows of a D that no tile width equals
SHAPES = list(parity.CASES["rms_norm"][1]) + [(300, 200), (2, 150, 96)]


@pytest.mark.parametrize("dt", ["fp32", "bf16"])
@pytest.mark.parametrize("index", range(len(tk.BWD_OPTIONS)))
def test_rms_norm_backward_each_autotune_candidate(index, dt, device, seed, monkeypatch):
    parity._skip_unless_runs("rms_norm", "triton", device)
    from tileport import triton_rows
    from tileport.autotuning import configs

    option = tk.BWD_OPTIONS[index]
    monkeypatch.setattr(tk._rms_norm_bwd_kernel, "configs", configs([option]))
    monkeypatch.setattr(tk._rms_norm_bwd_kernel, "cache", {})
    dtype = parity.DTYPES[dt]

    def run(shapes):
        ran = 0
        for shape in shapes:
            if on_gpu() and not tk.candidate_fits(option, shape[-1], dtype.itemsize):
                continue  # the autotuner prunes it for this row width and dtype
            parity.run_and_check("rms_norm", "triton", parity._rms_case(shape, dtype, device), dtype, seed)
            ran += 1
        return ran

    ran = run(SHAPES)
    monkeypatch.setattr(tk, "_MAX_TILE_D", 64)  # chunked rows: 64-column chunks
    ran += run([(7, 200), (33, 64 * 3), (300, 200)])
    monkeypatch.setattr(triton_rows, "_PREFER_DESCRIPTORS", False)  # raw pointers on aligned rows
    ran += run([(300, 200)])
    assert ran or on_gpu(), f"candidate {option} ran no shape"


@pytest.mark.parametrize("P,D", [(1, 5), (2, 96), (300, 100), (132, 4096)])
def test_sum_partial_rows(P, D, device, seed):
    """triton_rows.sum_partial_rows against float64: one row, a D tail under one column block, P
    over one load of rows (256) with a ragged second load, and the standard shape's 132 x 4096;
    in fp32 and into a bf16 weight gradient; the same bits in two runs."""
    parity._skip_unless_runs("rms_norm", "triton", device)
    from tileport.triton_rows import sum_partial_rows

    part = torch.randn(P, D, device=device) * (1.0 + torch.rand(P, 1, device=device))
    ref = part.double().sum(dim=0)
    for dtype in (torch.float32, torch.bfloat16):
        with poisoned():
            out = sum_partial_rows(part, torch.full((D,), float("nan"), dtype=dtype, device=device))
            again = sum_partial_rows(part, torch.full((D,), float("nan"), dtype=dtype, device=device))
        assert out.dtype == dtype
        check(f"sum of {P} partial rows into {dtype}", out, ref, dtype)
        assert torch.equal(out, again), "the sum differs between two runs"


def test_rms_norm_backward_torch_sum_form(device, seed, monkeypatch):
    """DW_SUM = "torch" (the old form, kept for scripts/rows_backward_ab.py's A/B) still passes."""
    parity._skip_unless_runs("rms_norm", "triton", device)
    monkeypatch.setattr(tk, "DW_SUM", "torch")
    parity.run_and_check("rms_norm", "triton", parity._rms_case((300, 200), torch.bfloat16, device), torch.bfloat16,
                         seed)
