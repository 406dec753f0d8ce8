"""cuTile (NVIDIA `cuda.tile`) backends: the toolchain check they share, their launch helper, and
ahead-of-time compilation for sm_90 on a machine without a GPU (CI's compile checks).

What was found on the CPU machine (2026-11-29, cuda-tile 1.7.0), which issue 8 asked about:
- cuda.tile's front end (Python AST -> Tile IR bytecode) needs neither a GPU nor a driver:
  `cuda.tile.compilation.export_kernel(..., output_format="tileir_bytecode")` runs on the CPU.
- `export_kernel(..., gpu_code="sm_90", output_format="cubin")` builds a Hopper cubin there too,
  when tileiras, ptxas and libnvvm of one CUDA release (13.4.92) sit together. With the pip
  wheels nvidia-cuda-tileiras, nvidia-cuda-nvcc and nvidia-nvvm installed beside cuda-tile
  (`scripts/fetch_cutile`), cuda.tile finds them by itself. tileiras reaches Hopper only from
  13.3 on; against an older ptxas it exits with status 5.
So CI compiles every cuTile kernel for sm_90 (tests/test_cutile_compile.py); only running them
needs the H200, where the toolchain has to be carried (that machine has no network):
`scripts/fetch_cutile --pack` builds the archive and `scripts/gpu-check` unpacks it.

Each op with cuTile kernels has `ops/<op>/cutile_kernels.py` with its stage functions and a
`compile_cases()` list; `all_compile_cases()` walks the ops packages for them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pkgutil
import re
import subprocess
from dataclasses import dataclass, field
from typing import Any, Callable

from tileport.shapes import next_pow2

__all__ = ["MIN_TILEIRAS", "toolchain_refusal", "cutile_available", "launch", "CutileCompileCase",
           "array_spec", "list_spec", "scalar_spec", "export_cubin", "all_compile_cases", "row_tiles"]

MIN_TILEIRAS = (13, 3)  # the first tileiras that targets sm_90


def _tileiras_version(path: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


@functools.cache
def toolchain_refusal() -> str | None:
    """Why cuTile kernels cannot be compiled here (None when they can): cuda.tile must import and
    find a tileiras of release 13.3 or newer."""
    try:
        import cuda.tile  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        return f"cuda.tile is not importable ({type(exc).__name__}: {exc}); run scripts/fetch_cutile"
    try:
        from cuda.tile._compile import _find_compiler_bin

        binary = _find_compiler_bin()
    except Exception as exc:  # noqa: BLE001
        return f"no tileiras compiler for cuda.tile ({exc}); run scripts/fetch_cutile"
    version = _tileiras_version(binary.path)
    if version is None:
        return f"could not read the release of {binary.path} (`tileiras --version`)"
    if version < MIN_TILEIRAS:
        return (f"tileiras {version[0]}.{version[1]} at {binary.path} cannot compile for Hopper "
                f"(needs {MIN_TILEIRAS[0]}.{MIN_TILEIRAS[1]} or newer, with its own ptxas and libnvvm)")
    return None


def cutile_available(module: str) -> Callable[[], str | None]:
    """The availability check every cuTile backend shares: the toolchain compiles for the device,
    the op's kernel module imports, and there is a CUDA device of compute capability 9.0 or newer
    (tileiras 13.x's oldest target here is Hopper)."""

    def available() -> str | None:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device (cuTile kernels only compile on the CPU: tests/test_cutile_compile.py)"
        reason = toolchain_refusal()
        if reason:
            return reason
        importlib.import_module(module)
        cap = torch.cuda.get_device_capability()
        if cap < (9, 0):
            return f"cuTile via tileiras 13.x targets sm_90 and newer; this device is sm_{cap[0]}{cap[1]}"
        return None

    return available


def launch(kernel, grid: tuple[int, ...], args: tuple) -> None:
    """Launch `kernel` on torch's current stream (cuTile compiles it on first use per signature)."""
    import cuda.tile as ct
    import torch

    ct.launch(torch.cuda.current_stream(), grid, kernel, args)


# --------------------------------------------------------------------------------------------
# ahead-of-time compilation (CPU)
# --------------------------------------------------------------------------------------------
@dataclass
class CutileCompileCase:
    """One kernel specialisation to build for sm_90: `params` in the kernel's parameter order,
    arrays as `array_spec(...)`, constants as plain Python values."""

    name: str
    kernel: Any
    params: list
    notes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _ArraySpec:
    dtype: str  # cuda.tile dtype name: "bfloat16", "float16", "float32", ...
    ndim: int


def array_spec(dtype: str, ndim: int) -> _ArraySpec:
    """A contiguous array argument: last stride 1, 16-byte aligned base (what torch allocates)."""
    return _ArraySpec(dtype, ndim)


@dataclass(frozen=True)
class _ListSpec:
    element: _ArraySpec


def list_spec(element: _ArraySpec) -> _ListSpec:
    """A list-of-arrays argument (each element like `element`; they do not alias one another)."""
    return _ListSpec(element)


@dataclass(frozen=True)
class _ScalarSpec:
    dtype: str


def scalar_spec(dtype: str) -> _ScalarSpec:
    """A runtime scalar argument (not a compile-time constant), e.g. "int32"."""
    return _ScalarSpec(dtype)


def _constraint(p):
    from cuda.tile.compilation import ArrayConstraint

    import cuda.tile as ct

    if isinstance(p, _ScalarSpec):
        from cuda.tile.compilation import ScalarConstraint

        return ScalarConstraint(getattr(ct, p.dtype))
    if isinstance(p, _ListSpec):
        from cuda.tile.compilation import ListConstraint

        return ListConstraint(_constraint(p.element), alias_groups=(), elements_may_alias=False)
    if isinstance(p, _ArraySpec):
        return ArrayConstraint(getattr(ct, p.dtype), p.ndim, index_dtype=ct.int32, stride_lower_bound_incl=0,
                               alias_groups=(), may_alias_internally=False,
                               stride_constant=(None,) * (p.ndim - 1) + (1,), base_addr_divisible_by=16)
    return p


def export_cubin(case: CutileCompileCase, gpu_code: str = "sm_90") -> bytes:
    """The sm_90 cubin of `case` (raises cuda.tile's compiler error when it does not build)."""
    import io

    from cuda.tile.compilation import CallingConvention, KernelSignature, export_kernel

    sig = KernelSignature([_constraint(p) for p in case.params], CallingConvention.cutile_python_v1())
    sig = sig.with_mangled_symbol(case.kernel._annotated_function.pyfunc.__name__)
    buf = io.BytesIO()
    export_kernel(case.kernel, [sig], buf, gpu_code=gpu_code, output_format="cubin")
    return buf.getvalue()


def all_compile_cases() -> list[CutileCompileCase]:
    """Every op's `cutile_kernels.compile_cases()` (an op joins by having the module)."""
    import tileport.ops as ops

    cases = []
    for info in pkgutil.iter_modules(ops.__path__):
        spec = importlib.util.find_spec(f"tileport.ops.{info.name}.cutile_kernels")
        if spec is None:
            continue
        cases.extend(importlib.import_module(f"tileport.ops.{info.name}.cutile_kernels").compile_cases())
    return cases


# --------------------------------------------------------------------------------------------
# row-wise ops: tile shapes shared by the cuTile kernels of rms_norm and softmax
# --------------------------------------------------------------------------------------------
ROW_TILE_ELEMS = 8192  # elements of one program's [BM, BD] tile: 32 KB of fp32 per tile


def row_tiles(M: int, D: int, max_bd: int) -> tuple[int, int]:
    """(BM, BD) for M rows of width D: BD = the next power of two above D (at least 16) when it is
    at most `max_bd`, else `max_bd` (the kernel then walks the row in chunks); BM rows per program
    so that BM * BD is about ROW_TILE_ELEMS (power of two, at most next_pow2(M))."""
    bd = max(16, next_pow2(D))
    bd = min(bd, max_bd)
    bm = max(1, min(ROW_TILE_ELEMS // bd, next_pow2(max(M, 1)), 64))
    return bm, bd
