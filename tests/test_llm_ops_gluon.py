"""The LLM ops' "gluon" backends against the float64 references, forward and backward, through the
frozen gate's checker (tests/test_llm_ops_parity.py, `run_and_check`), on the shapes they accept:
- rms_norm and softmax (the forward as a persistent TMA ring over row tiles,
  tileport/gluon_rows.py; the backward Triton's): the gate's own power-of-two rows, and rows chosen
  here for the ring's corners (one row; fewer tiles than programs; many tiles per program, with a
  ragged last tile; a tile of one row at D = 8192; a [B, T, D] input; fp32 with 4-byte elements);
  rows TMA cannot read (an unaligned row stride) run Triton's forward: checked too;
- grouped GEMM (the forward on a persistent pipelined TMA + WGMMA kernel; the backward Triton's),
  16-bit: the gate's cases (groups of 0 and 1 rows, K and N not multiples of the tiles; those with
  rows TMA cannot read run Triton's forward) and one where the items outnumber the programs.
GPU only: on the CPU tests/test_gluon_compile.py compile-checks the kernels for sm_90a instead, and
the refusals are checked here.
"""

from __future__ import annotations

import pytest
import test_llm_ops_parity as parity  # a module import: pytest would collect imported test functions
import torch

import tileport
from tileport.ops.rms_norm.reference import rms_norm_reference
from tileport.ops.softmax.reference import softmax_reference

OPS = ("rms_norm", "softmax")
MAKERS = {"rms_norm": parity._rms_case, "softmax": parity._softmax_case}
# the gate's shapes these kernels accept, and the ring's corners
SHAPES = [(130, 64), (1, 128), (7, 256), (4097, 4096), (333, 8192), (2, 300, 1024), (20000, 512)]


def _accepted(op: str, shape, dtype) -> bool:
    from tileport.gluon_rows import rows_refusal

    return rows_refusal(shape[-1], dtype) is None


@pytest.mark.parametrize("dt", list(parity.DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", OPS)
def test_forward_backward(op, shape, dt, device, seed):
    parity._skip_unless_runs(op, "gluon", device)
    dtype = parity.DTYPES[dt]
    assert _accepted(op, shape, dtype), (op, shape, dt)
    parity.run_and_check(op, "gluon", MAKERS[op](shape, dtype, device), dtype, seed)


@pytest.mark.parametrize("op", OPS)
def test_unaligned_rows_run_triton(op, device, seed):
    """A row stride TMA cannot read (D = 64 bf16 rows in a buffer 65 wide): the same results, by
    Triton's forward."""
    parity._skip_unless_runs(op, "gluon", device)
    base = torch.randn(33, 65, device=device).to(torch.bfloat16)
    x = base[:, :64]
    if op == "rms_norm":
        w = (0.5 + torch.rand(64, device=device)).to(torch.bfloat16)
        make = (lambda: tileport.rms_norm(x, w)), [x, w], (lambda: rms_norm_reference(x, w))
    else:
        make = (lambda: tileport.softmax(x)), [x], (lambda: softmax_reference(x))
    parity.run_and_check(op, "gluon", make, torch.bfloat16, seed)


GG_SHAPES = parity.CASES["grouped_gemm"][1] + parity.GPU_EXTRA["grouped_gemm"] + [((4096,) * 8, 1024, 2048)]


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", GG_SHAPES, ids=parity._shape_id)
def test_grouped_gemm(shape, dt, device, seed):
    parity._skip_unless_runs("grouped_gemm", "gluon", device)
    dtype = parity.DTYPES[dt]
    parity.run_and_check("grouped_gemm", "gluon", parity._gg_case(shape, dtype, device), dtype, seed)


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
