"""Every cuTile kernel compiles for sm_90 on a CPU-only machine (issue 8's question, answered yes).

cuda.tile's front end runs without a GPU or driver, and `export_kernel` builds the cubin with the
tileiras, ptxas and libnvvm of CUDA 13.4 that `scripts/fetch_cutile` installs beside it
(tileport.cutile_support explains). The cases come from `compile_cases()` of each op's
`cutile_kernels` module. Without the toolchain these tests skip with the reason (scripts/test
fetches it first); running the kernels needs the H200 (tests/test_llm_ops_parity.py).
"""

from __future__ import annotations

import struct

import pytest

from tileport.cutile_support import toolchain_refusal

_REASON = toolchain_refusal()
if _REASON:
    pytest.skip(f"cuTile toolchain: {_REASON}", allow_module_level=True)

import cuda.tile as ct  # noqa: E402 (the kernel below resolves `ct` among the module's globals)

from tileport.cutile_support import CutileCompileCase, all_compile_cases, array_spec, export_cubin  # noqa: E402

CASES = all_compile_cases()
EM_CUDA = 190


def test_every_row_op_has_cutile_kernels():
    ops = {c.name.split()[0] for c in CASES}
    assert {"rms_norm", "softmax", "swiglu", "rope", "grouped_gemm"} <= ops, ops
    assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cutile_kernel_compiles_for_sm90(case):
    cubin = export_cubin(case, "sm_90")
    assert cubin[:4] == b"\x7fELF", case.name
    machine = struct.unpack_from("<H", cubin, 18)[0]
    flags = struct.unpack_from("<I", cubin, 48)[0]
    assert machine == EM_CUDA, f"{case.name}: ELF machine {machine}, not CUDA"
    assert (flags >> 8) & 0xFF == 90, f"{case.name}: cubin for sm_{(flags >> 8) & 0xFF}, not sm_90 (flags {flags:#x})"


def test_a_broken_kernel_fails_to_compile():
    """The check can fail: a kernel with a shape error does not produce a cubin."""
    @ct.kernel
    def mismatched(x, y, B: ct.Constant[int]):
        t = ct.load(x, index=(ct.bid(0),), shape=(B,))
        ct.store(y, index=(ct.bid(0),), tile=ct.reshape(t, (B, 2)))  # B elements cannot take shape (B, 2)

    with pytest.raises(Exception, match="(?i)shape|reshape"):
        export_cubin(CutileCompileCase("broken", mismatched, [array_spec("float32", 1), array_spec("float32", 1), 64]))
