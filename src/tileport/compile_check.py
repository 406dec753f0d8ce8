"""Compile Gluon (or Triton) kernels for sm_90a on a machine without a GPU.

CI has no GPU, but `triton.compile` accepts a kernel's AST source with an explicit target
(`GPUTarget("cuda", 90, 32)`) and runs the whole pipeline down to a cubin with the ptxas that
ships in the triton wheel. That proves, on every commit, that each Gluon kernel still compiles
for Hopper and still emits the instructions it was written for (TMA, mbarriers, ...), and it
reports the register, spill and shared-memory budget ptxas gave it.

The source is built the way `triton/_filecheck.py` (`run_parser`) and
`triton/experimental/gluon/_runtime.py` do it: bind the arguments with the kernel's binder,
pack them into signature / constexprs / attributes, and wrap them in `GluonASTSource`
(`ASTSource` for plain `@triton.jit` kernels). Tensors are stand-ins that only carry
`data_ptr()`, `dtype`, `shape` and `stride()`; TMA descriptors are real
`triton.experimental.gluon.nvidia.hopper.TensorDescriptor` objects around such a stand-in.

Every op that has Gluon kernels exposes `compile_cases()` in `tileport.ops.<op>.gluon_kernels`;
`all_cases()` finds them by walking the `tileport.ops` packages, so a new op joins by itself.
"""

from __future__ import annotations

import contextlib
import io
import pkgutil
import re
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CompileCase",
    "CompiledReport",
    "TensorStandIn",
    "all_cases",
    "compile_case",
    "descriptor_stand_in",
    "HOPPER",
    "sass_census",
    "loop_barriers",
]

HOPPER = ("cuda", 90, 32)


class TensorStandIn:
    """What the binder looks at in a tensor argument: data_ptr, dtype, shape, stride.

    `align` is the byte alignment `data_ptr()` reports (16 keeps the pointer's divisibility
    specialisation, like a fresh torch allocation does).
    """

    def __init__(self, shape, dtype, strides=None, align: int = 16):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        if strides is None:
            strides, acc = [], 1
            for s in reversed(self.shape):
                strides.append(acc)
                acc *= max(int(s), 1)
            strides = tuple(reversed(strides))
        self._strides = tuple(int(s) for s in strides)
        self._ptr = 1 << 20 if align % 16 == 0 else (1 << 20) + align

    def data_ptr(self) -> int:
        return self._ptr

    def stride(self, dim: int | None = None):
        return self._strides if dim is None else self._strides[dim]

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __repr__(self) -> str:
        return f"TensorStandIn({list(self.shape)}, {self.dtype})"


def descriptor_stand_in(shape, dtype, block_shape, layout, strides=None):
    """A Gluon host TensorDescriptor over a TensorStandIn (what a TMA argument binds to)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    base = TensorStandIn(shape, dtype, strides)
    return TensorDescriptor(base, list(base.shape), list(base.stride()), list(block_shape), layout)


@dataclass
class CompileCase:
    """One kernel in one configuration.

    args: every kernel parameter by name (values, stand-ins, descriptors, constexprs; None for
    optional pointers the configuration leaves out).
    expect_ptx: substrings the PTX must contain (e.g. "cp.async.bulk.tensor", "mbarrier").
    options: extra compile options (e.g. {"maxnreg": 168}).
    """

    name: str
    kernel: Any
    args: dict
    num_warps: int = 4
    expect_ptx: list = field(default_factory=list)
    num_ctas: int = 1
    options: dict = field(default_factory=dict)
    target: tuple = HOPPER
    expect_max_spills: int | None = None  # when set, the test also bounds the spill bytes
    expect_max_shared: int | None = None  # when set, the test bounds the CTA's shared memory (bytes)
    expect_loop_barriers: int | None = None  # when set, the CTA barriers in the kernel's one outer loop (PTX)


@dataclass
class CompiledReport:
    name: str
    ptx: str
    n_regs: int | None
    n_spills: int | None  # spill store bytes reported by ptxas
    shared: int | None  # static shared memory the kernel asks for, bytes
    missing_ptx: list
    target_line: str | None
    compile_s: float
    ptxas_log: str = ""
    metadata: Any = None
    asm: dict = field(default_factory=dict, repr=False)  # every stage's text/binary (ttgir, llir, ptx, cubin)

    def summary(self) -> str:
        return (f"{self.name}: regs={self.n_regs} spills={self.n_spills} smem={self.shared} "
                f"compile={self.compile_s:.1f}s")


_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores")


def _parse_ptxas_log(log: str):
    regs = _REGS.findall(log)
    spills = _SPILL.findall(log)
    return (int(regs[-1]) if regs else None), (int(spills[-1]) if spills else None)


def _ptxas_rerun(ptx: str, arch: str):
    """Fallback when the compile came from the cache: run ptxas -v on the PTX ourselves."""
    import os
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True)
        return out.stderr + out.stdout


_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")


def loop_barriers(ptx: str) -> list[int]:
    """CTA barriers (`bar.sync` / `barrier.sync`) in each outermost loop of the PTX, from its header
    label to the last branch back to it: static counts, i.e. per iteration when the body has no
    branches around them. For the row kernels that is per tile (docs/perf/llm_ops.md, "gluon
    softmax"): what a reduction across warps costs is a round through shared memory between
    barriers, which registers and spills do not show."""
    lines = ptx.splitlines()
    counts = []
    for i, line in enumerate(lines):
        # the header comment sits on the label's line or on the line after it
        if "Loop Header: Depth=1" not in line:
            continue
        head = _LABEL.match(line.strip()) or (i > 0 and _LABEL.match(lines[i - 1].strip()))
        if not head:
            continue
        back = re.compile(r"\bbra(\.uni)?\s+" + re.escape(head.group(1)) + r";")
        end = max((j for j in range(i + 1, len(lines)) if back.search(lines[j])), default=None)
        if end is not None:
            counts.append(sum(bool(re.search(r"\b(bar|barrier)\.sync\b", ln)) for ln in lines[i:end]))
    return counts


_SASS_OP = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def sass_census(report: CompiledReport) -> dict[str, int]:
    """{opcode: count} over the kernel's SASS (cuobjdump of its cubin; static counts: a loop body
    counts once), plus "total". What the instruction mix says that registers and spills do not:
    e.g. 880 of the GDN tile solve's 3752 instructions were FFMA, fp32 products on FMA units
    (docs/perf/gdn.md, row 26). Needs the cuobjdump that ships in the triton wheel."""
    import os
    import subprocess
    import tempfile
    from collections import Counter

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(report.asm["cubin"])
        text = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    counts = Counter(m.group(1) for m in map(_SASS_OP.match, text.splitlines()) if m)
    counts["total"] = sum(counts.values())
    return dict(counts)


def compile_case(case: CompileCase) -> CompiledReport:
    """Compile `case.kernel` for the case's target (sm_90a by default) without a driver."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    kernel = case.kernel
    target = GPUTarget(*case.target)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)

    kwargs = dict(case.args)
    kwargs["num_warps"] = case.num_warps
    kwargs["num_ctas"] = case.num_ctas
    kwargs.update(case.options)
    # the same options JITFunction.run adds, so a case's cache key matches a real launch
    kwargs.setdefault("debug", bool(knobs.runtime.debug))
    kwargs.setdefault("instrumentation_mode", knobs.compilation.instrumentation_mode)
    bound_args, specialization, options = binder(**kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    is_gluon = getattr(kernel, "is_gluon", lambda: False)()
    src = (GluonASTSource if is_gluon else ASTSource)(kernel, signature, constexprs, attrs)

    t0 = time.perf_counter()
    log = io.StringIO()
    old_dump, old_always = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    try:
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=target, options=options.__dict__)
    finally:
        knobs.nvidia.dump_ptxas_log = old_dump
        knobs.compilation.always_compile = old_always
    elapsed = time.perf_counter() - t0

    ptx = compiled.asm.get("ptx", "")
    if isinstance(ptx, bytes):
        ptx = ptx.decode()
    ptxas_log = log.getvalue()
    n_regs, n_spills = _parse_ptxas_log(ptxas_log)
    if n_regs is None and ptx:
        ptxas_log = _ptxas_rerun(ptx, f"sm_{case.target[1]}a" if case.target[1] >= 90 else f"sm_{case.target[1]}")
        n_regs, n_spills = _parse_ptxas_log(ptxas_log)
    md = compiled.metadata
    shared = getattr(md, "shared", None)
    target_line = next((ln.strip() for ln in ptx.splitlines() if ln.strip().startswith(".target")), None)
    missing = [s for s in case.expect_ptx if s not in ptx]
    return CompiledReport(case.name, ptx, n_regs, n_spills, shared, missing, target_line, elapsed, ptxas_log, md,
                          dict(compiled.asm))


def _gluon_kernel_modules():
    """Every `tileport.ops.<op>.gluon_kernels` module, found by walking the tileport.ops packages.

    Op packages may be regular or namespace packages (a directory without __init__.py), which
    pkgutil.iter_modules does not list, so the directories are scanned as well.
    """
    import importlib.util
    import os

    import tileport.ops as ops_pkg

    ops = set()
    for info in pkgutil.iter_modules(ops_pkg.__path__):
        if info.ispkg:
            ops.add(info.name)
    for root in ops_pkg.__path__:
        if not os.path.isdir(root):
            continue
        for entry in os.listdir(root):
            if entry.isidentifier() and not entry.startswith("_") and os.path.isdir(os.path.join(root, entry)):
                ops.add(entry)
    mods = []
    for op in sorted(ops):
        name = f"{ops_pkg.__name__}.{op}.gluon_kernels"
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            mods.append(importlib.import_module(name))
    return mods


def all_cases() -> list[CompileCase]:
    """compile_cases() of every op's gluon_kernels module, in module order."""
    cases = []
    for mod in _gluon_kernel_modules():
        fn = getattr(mod, "compile_cases", None)
        if fn is not None:
            cases.extend(fn())
    return cases
