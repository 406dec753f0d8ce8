"""`tileport lint [paths]`: a static checker for silent Triton/Gluon pitfalls (triton 3.6).

It reads source files with `ast` and never imports the code it checks. Kernels are functions
decorated with `triton.jit` / `gluon.jit` (bare or called, alone or under `triton.autotune` and
friends); helpers decorated the same way are kernels too. Calls from one kernel to a helper in the
same file are followed: the helper's operations are replayed at the call site with its parameters
bound to the caller's arguments, so a pattern that spans a kernel and its helpers is found, and is
reported on the kernel's line (the call site), once.

Rules (`tileport lint --list-rules` prints them):
  TP000  a `# lint: allow` comment without a reason, with an unknown rule id, or malformed.
  TP001  a 2D+ tile moved by tl/gl.load / tl/gl.store (or Ampere cp.async) through raw pointers
         whose offsets are built by broadcasting (`x[:, None]`, `x[None, :]`, `expand_dims`)
         where a TMA descriptor would fit. Gluon: always. Triton: only in kernels that use no
         tensor descriptors (a kernel that already uses `tl.make_tensor_descriptor` / `desc.load`
         chose raw pointers for the rest on purpose).
  TP002  shared memory written by `<smem>.store(...)`, then read by a TMA store
         (`tma.async_copy_shared_to_global`) or by `warpgroup_mma`, with no
         `fence_async_shared()` in between (source order, loop bodies taken twice).
  TP003  `warpgroup_mma_wait(...)` whose result is dropped (expression statement, or assigned to
         names that are never read).
  TP004  an mbarrier `mbarrier.init`-ed in a kernel and never `mbarrier.invalidate`-d there; or one
         barrier used both for TMA completion (`async_copy_global_to_shared`) and for MMA
         completion (`mbarriers=`, `tcgen05_commit`, or `mbarrier.arrive` right after
         `warpgroup_mma_wait`).
  TP005  the triton 3.6 WGMMA race (triton issue 11047): a refill (TMA load, cp.async or
         `.store`) of a buffer that feeds `warpgroup_mma`, after `warpgroup_mma_wait` with no
         `gl.thread_barrier()` in between, unless every launch of the kernel in the file is visibly
         at most 4 warps (a `kernel[grid](...)` call with a literal `num_warps` <= 4, or none:
         the default is 4; autotune configs likewise).
  TP006  a module-level global read inside a kernel. Allowed: functions, classes, imports (except
         UPPER_CASE names imported from outside triton, which look like constants),
         `X = tl.constexpr(v)` / `gl.constexpr(v)`, and values taken from tl/gl (dtypes).
         `X: tl.constexpr = v` is flagged too: triton 3.6 rejects it (checked on 3.6.0: NameError
         "Cannot access global variable"); only `X = tl.constexpr(v)` works.
  TP007  a Triton kernel (one no other kernel in the file calls) with pointer arguments, no tensor
         descriptors and no `tl.multiple_of` / `tl.max_contiguous` anywhere (its helpers included).
         One finding per kernel, on its `def` line.

Suppression: `# lint: allow TP001 -- why it is fine` on the flagged line, on any line of the flagged
statement, or on the line above it (for findings on a `def` line: also on its decorators or the
line above them). `# lint: allow-function TP001 -- why` on the `def` line, a decorator line, the
line above them or a line of a multi-line signature covers the whole function for those rules.
Several ids: `allow TP001,TP007 -- ...`. A suppression without a reason suppresses nothing and is
itself a TP000 finding. Suppressed findings are printed only with `--show-suppressed`.

Exit status: 1 when there are (unsuppressed) findings, 0 when clean, 2 when a path is missing or a
file does not parse.

Known blind spots (static, one file at a time): helpers imported from another module are not followed;
kernels built by calling `triton.jit(fn)` are not seen; buffers and barriers are told apart by the
variable they were allocated into (`bars.index(0)` and `bars.index(1)` are the same barrier `bars`);
branches are taken in source order, both of them, so a fence in one branch of an `if` counts for the
other; `gl.warp_specialize` partitions are checked as separate kernels (a barrier shared between
partitions is not seen); TP007 cannot tell when Triton's own axis analysis already proves contiguity
(`pid * BLOCK + tl.arange(0, BLOCK)`, constexpr row strides), so it is advisory.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["RULES", "Finding", "lint_source", "lint_paths", "add_arguments", "main"]

RULES: dict[str, tuple[str, str]] = {
    "TP000": ("bad suppression comment",
              "a suppression must name known rule ids and give a reason after `--`, so the next reader knows "
              "why the pitfall does not apply"),
    "TP001": ("2D tile through raw pointers where a TMA descriptor would fit",
              "per-thread address math and masks cost registers and LSU issue slots; a TMA descriptor moves the "
              "tile in one bulk copy with hardware bounds handling"),
    "TP002": ("shared memory written by .store() then read by TMA store / WGMMA without fence_async_shared()",
              "generic-proxy writes are not visible to the async proxy (TMA, wgmma) without a proxy fence: the "
              "copy or MMA can read stale shared memory"),
    "TP003": ("warpgroup_mma_wait() result unused",
              "in triton 3.6 the wait returns the tensors it waited for; code that keeps using the old values "
              "has no dependency on the wait and can read them before the MMA is done"),
    "TP004": ("mbarrier lifecycle / sharing",
              "an mbarrier must be invalidated before its shared memory is reused, and one barrier must not "
              "count both TMA and MMA completion (arrivals and phases of the two get mixed up)"),
    "TP005": ("WGMMA operand refilled right after warpgroup_mma_wait without gl.thread_barrier()",
              "triton 3.6 race (issue 11047): with more than 4 warps another warpgroup's wgmma may still read "
              "the buffer; put gl.thread_barrier() between the wait and the refill"),
    "TP006": ("module-level global read inside a kernel",
              "triton 3.6 only lets kernels read globals that are tl.constexpr(...) objects (NameError when "
              "compiling; the CPU interpreter accepts them): pass the value as a constexpr argument"),
    "TP007": ("Triton kernel without alignment hints",
              "without tl.multiple_of / tl.max_contiguous on offsets the compiler cannot prove 16-byte "
              "contiguity and may emit narrow loads/stores instead of 128-bit vectors"),
}

# calls whose result is data, not an address: the broadcast of a pointer does not flow through them
_DATA_CALLS = {"load", "sum", "max", "min", "reduce", "argmax", "argmin", "xor_sum", "reduce_or", "dot",
               "dot_scaled", "atomic_add", "atomic_max", "atomic_min", "atomic_cas", "atomic_xchg",
               "atomic_and", "atomic_or", "atomic_xor", "histogram", "program_id", "num_programs"}
# methods that give a view of the same shared-memory buffer / barrier array
_VIEW_METHODS = {"index", "slice", "_reinterpret", "reinterpret", "permute", "reshape", "trans", "subslice",
                 "split", "_keep_alive"}
_DESC_CALLS = {"make_tensor_descriptor", "_experimental_make_tensor_descriptor", "_experimental_descriptor_load",
               "_experimental_descriptor_store", "load_tensor_descriptor", "store_tensor_descriptor"}
_HINT_CALLS = {"multiple_of", "max_contiguous"}
_PTR_NAME = re.compile(r"(^|_)ptrs?$")
_UPPER = re.compile(r"^[A-Z][A-Z0-9_]+$")
_SUPPRESS = re.compile(r"#\s*lint\s*:\s*(.*)$")
_ALLOW = re.compile(r"^(allow|allow-function)\s+([A-Za-z0-9_,\s]+?)\s*(?:(?:--|\u2014)\s*(.*))?$")


@dataclass
class Finding:
    path: str
    line: int
    rule: str
    message: str
    first: int = 0  # suppression window: a comment on lines first..last applies
    last: int = 0
    func: str | None = None  # enclosing kernel
    suppressed: str | None = None  # the reason, when suppressed

    def format(self) -> str:
        why = RULES[self.rule][1]
        text = f"{self.path}:{self.line}: {self.rule} {self.message} \u2014 {why}"
        if self.suppressed is not None:
            text += f" [suppressed: {self.suppressed}]"
        return text


@dataclass
class _Ev:
    """One operation in a kernel's (inlined) operation sequence."""

    kind: str
    line: int  # line in the analysed function (the call site for replayed helper operations)
    first: int
    last: int
    roots: tuple = ()  # buffer / barrier roots (None: unknown)
    call: int | None = None  # id of the helper call it was replayed from (None: this function)
    via: str = ""  # helper chain, for messages
    op: str = ""
    bcast: bool = False  # LS: the pointer is a broadcast tile, made at this level
    below: bool = False  # LS: already reported inside a helper
    params: frozenset = frozenset()  # LS: parameters the pointer depends on
    bases: frozenset = frozenset()  # LS: parameters the pointer is offset from (additive operands)
    masked: bool = False
    used: bool = True  # WAIT: the result is used


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    parts.append(node.id)
    return ".".join(reversed(parts))


def _is_bcast_index(sl) -> bool:
    """`[:, None]`, `[None, :]`, `[:, None, :]`, ...: an index that adds axes to a sliced tensor."""
    if not isinstance(sl, ast.Tuple) or len(sl.elts) < 2:
        return False
    has_none = any(isinstance(e, ast.Constant) and e.value is None for e in sl.elts)
    has_slice = any(isinstance(e, ast.Slice) for e in sl.elts)
    return has_none and has_slice


def _arg(call: ast.Call, pos: int, name: str):
    for k in call.keywords:
        if k.arg == name:
            return k.value
    if pos < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[:pos + 1]):
        return call.args[pos]
    return None


# ------------------------------------------------------------------------------------------------
# module
# ------------------------------------------------------------------------------------------------
class _Module:
    def __init__(self, path: str, tree: ast.Module):
        self.path = path
        self.tree = tree
        self.imports: dict[str, str] = {}
        nodes = list(ast.walk(tree))
        self._calls = [n for n in nodes if isinstance(n, ast.Call)]
        for node in nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.imports[a.asname] = a.name
                    else:
                        self.imports[a.name.split(".")[0]] = a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = "." * node.level + (node.module or "")
                for a in node.names:
                    self.imports[a.asname or a.name] = f"{base}.{a.name}" if base else a.name
        self.bindings: dict[str, dict[str, int]] = {}  # name -> {kind: first line}
        self._collect_bindings(tree.body)
        self.jit: dict[str, tuple[ast.FunctionDef, str]] = {}
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.decorator_list:
                kind = self.jit_kind(node)
                if kind:
                    self.jit[node.name] = (node, kind)
        self.callees: dict[str, set[str]] = {name: set() for name in self.jit}
        spans = [(fn.lineno, fn.end_lineno, name) for name, (fn, _) in self.jit.items()]
        for c in self._calls:
            if isinstance(c.func, ast.Name) and c.func.id in self.jit:
                for lo, hi, name in spans:
                    if lo <= c.lineno <= hi and c.func.id != name:
                        self.callees[name].add(c.func.id)
        self.callers: dict[str, set[str]] = {n: set() for n in self.jit}
        for name, cs in self.callees.items():
            for c in cs:
                self.callers[c].add(name)
        self.warps = self._launch_warps()
        self._ctx: dict[str, _Func] = {}
        self._events: dict[str, list[_Ev]] = {}
        self._in_progress: set[str] = set()
        self._call_ids = 0

    # names ---------------------------------------------------------------------------------
    def qual(self, node) -> str:
        d = _dotted(node)
        if not d:
            return ""
        head, _, rest = d.partition(".")
        if head in self.imports:
            head = self.imports[head]
        return f"{head}.{rest}" if rest else head

    @staticmethod
    def last(q: str) -> str:
        return q.rsplit(".", 1)[-1]

    def is_lang(self, q: str, names) -> bool:
        """q is tl.X / gl.X (triton.language.X, triton.experimental.gluon.language.X)."""
        if not q:
            return False
        head, _, x = q.rpartition(".")
        if x not in names:
            return False
        return head in ("tl", "gl", "ttgl") or head.endswith("language") or head.startswith("triton.language")

    def jit_kind(self, fn) -> str | None:
        kind = None
        for d in fn.decorator_list:
            q = self.qual(d.func if isinstance(d, ast.Call) else d)
            parts = q.split(".") if q else []
            if not parts or parts[-1] != "jit":
                continue
            if "gluon" in parts:
                kind = "gluon"
            elif q == "jit" or parts[0] in ("triton", "tl") or "triton" in parts:
                kind = kind or "triton"
        return kind

    def _collect_bindings(self, body):
        def add(name, kind, line):
            self.bindings.setdefault(name, {}).setdefault(kind, line)

        def targets(t):
            if isinstance(t, ast.Name):
                yield t.id
            elif isinstance(t, (ast.Tuple, ast.List)):
                for e in t.elts:
                    yield from targets(e)
            elif isinstance(t, ast.Starred):
                yield from targets(t.value)

        for s in body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                add(s.name, "def", s.lineno)
            elif isinstance(s, (ast.Import, ast.ImportFrom)):
                src = s.module if isinstance(s, ast.ImportFrom) else None
                for a in s.names:
                    name = a.asname or a.name.split(".")[0]
                    external = isinstance(s, ast.ImportFrom) and not (src or "").startswith("triton")
                    add(name, "import-const" if external and _UPPER.match(name) else "import", s.lineno)
            elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                tlist = s.targets if isinstance(s, ast.Assign) else [s.target]
                kind = self._value_kind(s.value)
                if isinstance(s, ast.AnnAssign) and self.last(self.qual(s.annotation)) == "constexpr" \
                        and kind != "constexpr":
                    kind = "annotated"
                for t in tlist:
                    for n in targets(t):
                        add(n, kind, s.lineno)
            elif isinstance(s, (ast.For, ast.AsyncFor)):
                for n in targets(s.target):
                    add(n, "value", s.lineno)
                self._collect_bindings(s.body + s.orelse)
            elif isinstance(s, ast.While):
                self._collect_bindings(s.body + s.orelse)
            elif isinstance(s, ast.If):
                self._collect_bindings(s.body + s.orelse)
            elif isinstance(s, (ast.With, ast.AsyncWith)):
                for it in s.items:
                    if it.optional_vars is not None:
                        for n in targets(it.optional_vars):
                            add(n, "value", s.lineno)
                self._collect_bindings(s.body)
            elif isinstance(s, ast.Try) or type(s).__name__ == "TryStar":
                self._collect_bindings(s.body + s.orelse + s.finalbody)
                for h in s.handlers:
                    self._collect_bindings(h.body)

    def _value_kind(self, v) -> str:
        if v is None:
            return "value"
        if isinstance(v, ast.Call):
            last = self.last(self.qual(v.func))
            if last == "constexpr":
                return "constexpr"
            if last == "jit":
                return "def"
            return "value"
        if isinstance(v, (ast.Attribute, ast.Name)):
            q = self.qual(v)
            if q.startswith(("triton.language", "tl.", "gl.")) or ".gluon.language" in q:
                return "lang"
            if isinstance(v, ast.Name) and v.id in self.bindings:
                kinds = self.bindings[v.id]
                if {"def", "import", "constexpr", "lang"} & kinds.keys():
                    return "def"
        if isinstance(v, ast.Lambda):
            return "def"
        return "value"

    def _launch_warps(self) -> dict[str, list]:
        """Kernel name -> num_warps of its visible launches (None: not a literal)."""
        warps: dict[str, list] = {n: [] for n in self.jit}

        def literal(call: ast.Call):
            if any(k.arg is None for k in call.keywords):
                return None  # **kwargs
            for k in call.keywords:
                if k.arg == "num_warps":
                    return k.value.value if isinstance(k.value, ast.Constant) and isinstance(k.value.value, int) \
                        else None
            return 4  # the default

        for node in self._calls:
            if isinstance(node.func, ast.Subscript) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in self.jit:
                warps[node.func.value.id].append(literal(node))
        for name, (fn, _) in self.jit.items():
            for d in fn.decorator_list:
                if isinstance(d, ast.Call) and self.last(self.qual(d.func)) == "autotune":
                    configs = _arg(d, 0, "configs")
                    if isinstance(configs, (ast.List, ast.Tuple)):
                        for c in configs.elts:
                            warps[name].append(literal(c) if isinstance(c, ast.Call) else None)
                    else:
                        warps[name].append(None)
        return warps

    def at_most_4_warps(self, name: str, seen=None) -> bool:
        seen = seen or set()
        if name in seen:
            return True
        seen.add(name)
        if self.callers.get(name):
            return all(self.at_most_4_warps(c, seen) for c in self.callers[name])
        ws = self.warps.get(name, [])
        return bool(ws) and all(w is not None and w <= 4 for w in ws)

    # analysis ------------------------------------------------------------------------------
    def func(self, name: str) -> _Func:
        if name not in self._ctx:
            fn, kind = self.jit[name]
            self._ctx[name] = _Func(self, fn, kind)
        return self._ctx[name]

    def events(self, name: str) -> list[_Ev]:
        if name not in self._events:
            self._in_progress.add(name)
            try:
                self._events[name] = self.func(name).build_events()
            finally:
                self._in_progress.discard(name)
        return self._events[name]

    def new_call_id(self) -> int:
        self._call_ids += 1
        return self._call_ids


class _Func:
    def __init__(self, mod: _Module, fn, kind: str):
        self.m = mod
        self.fn = fn
        self.kind = kind
        self.name = fn.name
        a = fn.args
        plist = a.posonlyargs + a.args + a.kwonlyargs
        self.params = [p.arg for p in plist] + [p.arg for p in (a.vararg, a.kwarg) if p is not None]
        self.positional = [p.arg for p in a.posonlyargs + a.args]
        self.constexpr_params = {p.arg for p in plist
                                 if p.annotation is not None and mod.last(mod.qual(p.annotation)) == "constexpr"}
        self.assigns: dict[str, list] = {}
        self.loaded: set[str] = set()
        self.local: set[str] = set(self.params)
        self._scan(fn.body)
        self._deps = self._solve_deps()

    # locals and assignments ------------------------------------------------------------------
    def _bind(self, target, value):
        if isinstance(target, ast.Name):
            self.assigns.setdefault(target.id, []).append(value)
            self.local.add(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for e in target.elts:
                self._bind(e, value)
        elif isinstance(target, ast.Starred):
            self._bind(target.value, value)

    def _scan(self, body):
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    self._bind(t, node.value)
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                self._bind(node.target, node.value)
            elif isinstance(node, ast.AnnAssign):
                self._bind(node.target, ast.Constant(value=None))
            elif isinstance(node, ast.AugAssign):
                self._bind(node.target, node.value)
            elif isinstance(node, ast.NamedExpr):
                self._bind(node.target, node.value)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                self._bind(node.target, node.iter)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for it in node.items:
                    if it.optional_vars is not None:
                        self._bind(it.optional_vars, it.context_expr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.local.add(node.name)
            elif isinstance(node, ast.Lambda):
                self.local.update(p.arg for p in node.args.args)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self.local.update((a.asname or a.name.split(".")[0]) for a in node.names)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                self.local.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                self.loaded.add(node.id)

    # data flow: does an expression hold a broadcast tile, and which parameters feed it ----------
    def _expr_deps(self, e, table) -> tuple[bool, frozenset]:
        bc = False
        ps: set = set()
        stack = [e]
        while stack:
            n = stack.pop()
            if isinstance(n, ast.Subscript) and _is_bcast_index(n.slice):
                bc = True
            if isinstance(n, ast.Call):
                q = self.m.qual(n.func)
                last = self.m.last(q) if q else (n.func.attr if isinstance(n.func, ast.Attribute) else "")
                if last in _DATA_CALLS and (self.m.is_lang(q, _DATA_CALLS) or isinstance(n.func, ast.Attribute)):
                    continue
                if self.m.is_lang(q, {"expand_dims"}):
                    bc = True
                stack.extend(n.args)
                stack.extend(k.value for k in n.keywords)
                if isinstance(n.func, ast.Attribute):
                    stack.append(n.func.value)
                continue
            if isinstance(n, ast.Name):
                b, p = table.get(n.id, (False, frozenset()))
                bc = bc or b
                ps |= p
                continue
            if isinstance(n, ast.Lambda):
                continue
            stack.extend(ast.iter_child_nodes(n))
        return bc, frozenset(ps)

    def _solve_deps(self):
        table = {p: (False, frozenset([p])) for p in self.params}
        for _ in range(50):
            changed = False
            for name, values in self.assigns.items():
                bc, ps = table.get(name, (False, frozenset()))
                for v in values:
                    b2, p2 = self._expr_deps(v, table)
                    bc, ps = bc or b2, ps | p2
                if table.get(name) != (bc, ps):
                    table[name] = (bc, ps)
                    changed = True
            if not changed:
                break
        return table

    def deps(self, e) -> tuple[bool, frozenset]:
        return self._expr_deps(e, self._deps)

    def bases(self, e, seen=None) -> frozenset:
        """Parameters that are additive operands of a pointer expression (`x_ptr + offs`, `res[l] + offs`),
        through local assignments: the base pointers, as opposed to sizes and strides."""
        seen = set() if seen is None else seen
        if isinstance(e, ast.Name):
            if e.id in self.params and e.id not in self.assigns:
                return frozenset([e.id])
            if e.id in seen:
                return frozenset()
            seen.add(e.id)
            out = frozenset([e.id]) if e.id in self.params else frozenset()
            for v in self.assigns.get(e.id, []):
                out |= self.bases(v, seen)
            return out
        if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub)):
            return self.bases(e.left, seen) | self.bases(e.right, seen)
        if isinstance(e, ast.Subscript):
            return self.bases(e.value, seen)
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in ("to", "cast"):
            return self.bases(e.func.value, seen)
        if isinstance(e, ast.Call) and self.m.is_lang(self.m.qual(e.func), {"where"}) and len(e.args) == 3:
            return self.bases(e.args[1], seen) | self.bases(e.args[2], seen)
        return frozenset()

    # roots: which buffer / barrier an expression names ---------------------------------------
    def _is_view(self, v) -> bool:
        if isinstance(v, ast.Subscript):
            return True
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr in _VIEW_METHODS:
            r = v.func.value
            return not (isinstance(r, ast.Name) and r.id in self.m.imports and r.id not in self.local)
        return False

    def root(self, e):
        for _ in range(32):
            if isinstance(e, ast.Name):
                vals = self.assigns.get(e.id)
                if e.id not in self.params and vals and len(vals) == 1 and self._is_view(vals[0]):
                    e = vals[0]
                    continue
                if e.id in self.m.imports and e.id not in self.local:
                    return None
                return e.id
            if isinstance(e, ast.Subscript):
                e = e.value
            elif isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in _VIEW_METHODS:
                e = e.func.value
            else:
                return None
        return None

    # the operation sequence ------------------------------------------------------------------
    def build_events(self) -> list[_Ev]:
        out: list[_Ev] = []
        self._walk(self.fn.body, out)
        return out

    def _walk(self, stmts, out):
        for s in stmts:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(s, (ast.For, ast.AsyncFor)):
                self._expr(s.iter, out, None)
                body: list[_Ev] = []
                self._walk(s.body, body)
                out.extend(body + body)  # twice: what the next iteration sees after this one
                self._walk(s.orelse, out)
            elif isinstance(s, ast.While):
                self._expr(s.test, out, None)
                body = []
                self._walk(s.body, body)
                out.extend(body + body)
                self._walk(s.orelse, out)
            elif isinstance(s, ast.If):
                self._expr(s.test, out, None)
                self._walk(s.body, out)
                self._walk(s.orelse, out)
            elif isinstance(s, (ast.With, ast.AsyncWith)):
                for it in s.items:
                    self._expr(it.context_expr, out, None)
                self._walk(s.body, out)
            elif isinstance(s, ast.Try) or type(s).__name__ == "TryStar":
                self._walk(s.body, out)
                for h in s.handlers:
                    self._walk(h.body, out)
                self._walk(s.orelse, out)
                self._walk(s.finalbody, out)
            elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                self._expr(s.value, out, s)
                for t in (s.targets if isinstance(s, ast.Assign) else [s.target]):
                    self._expr(t, out, s)
            else:
                for child in ast.iter_child_nodes(s):
                    if isinstance(child, ast.expr):
                        self._expr(child, out, s)

    def _expr(self, e, out, stmt):
        if e is None or isinstance(e, ast.Lambda):
            return
        if isinstance(e, ast.Call):
            for a in e.args:
                self._expr(a, out, stmt)
            for k in e.keywords:
                self._expr(k.value, out, stmt)
            if isinstance(e.func, ast.Attribute):
                self._expr(e.func.value, out, stmt)
            self._call(e, out, stmt)
            return
        for c in ast.iter_child_nodes(e):
            if isinstance(c, ast.expr):
                self._expr(c, out, stmt)

    def _wait_used(self, call, stmt) -> bool:
        if isinstance(stmt, ast.Expr) and stmt.value is call:
            return False
        if isinstance(stmt, ast.Assign) and stmt.value is call:
            names = [n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            return not names or any(n in self.loaded for n in names)
        return True

    def _call(self, call: ast.Call, out, stmt):
        m = self.m
        q = m.qual(call.func)
        last = m.last(q) if q else (call.func.attr if isinstance(call.func, ast.Attribute) else "")
        first = stmt.lineno if stmt is not None else call.lineno
        lst = stmt.end_lineno if stmt is not None else call.end_lineno

        def ev(kind, **kw):
            out.append(_Ev(kind, call.lineno, min(first, call.lineno), max(lst, call.end_lineno), **kw))

        for k in call.keywords:  # MMA completion barriers (tcgen05_mma, ...)
            if k.arg == "mbarriers" and isinstance(k.value, (ast.List, ast.Tuple)):
                for b in k.value.elts:
                    ev("MMA_BAR", roots=(self.root(b),), op=last)
        parts = q.split(".") if q else []
        if last == "fence_async_shared":
            ev("FENCE")
        elif m.is_lang(q, {"thread_barrier", "barrier", "debug_barrier"}):
            ev("BAR")
        elif last == "warpgroup_mma":
            ev("WGMMA", roots=(self.root(_arg(call, 0, "a")), self.root(_arg(call, 1, "b"))))
        elif last == "warpgroup_mma_wait":
            ev("WAIT", used=self._wait_used(call, stmt))
        elif last == "async_copy_global_to_shared":
            cp_async = "ampere" in parts or "async_copy" in parts[:-1] or (
                len(call.args) == 3 and not any(k.arg in ("barrier", "result") for k in call.keywords))
            if cp_async:
                ptr = _arg(call, 1, "pointer")
                if ptr is not None:
                    bc, ps = self.deps(ptr)
                    ev("LS", op="async_copy_global_to_shared", bcast=bc, params=ps, bases=self.bases(ptr),
                       masked=_arg(call, 2, "mask") is not None)
                ev("CP_ASYNC", roots=(self.root(_arg(call, 0, "smem")),))
            else:
                ev("TMA_LOAD", roots=(self.root(_arg(call, 3, "result")), self.root(_arg(call, 2, "barrier"))))
        elif last == "async_copy_shared_to_global":
            ev("TMA_STORE", roots=(self.root(_arg(call, 2, "src")),))
        elif len(parts) >= 2 and parts[-2] == "mbarrier" and last in ("init", "invalidate", "arrive", "wait",
                                                                       "expect"):
            ev("MB_" + last.upper(), roots=(self.root(_arg(call, 0, "mbarrier")),))
        elif last == "tcgen05_commit":
            ev("MMA_BAR", roots=(self.root(_arg(call, 0, "barrier")),), op=last)
        elif m.is_lang(q, {"load", "store"}):
            ptr = _arg(call, 0, "pointer")
            if ptr is not None:
                bc, ps = self.deps(ptr)
                op = q.replace("triton.language.", "tl.").replace("triton.experimental.gluon.language.", "gl.")
                masked = _arg(call, 1 if last == "load" else 2, "mask") is not None
                ev("LS", op=op, bcast=bc, params=ps, bases=self.bases(ptr), masked=masked)
        elif m.is_lang(q, _HINT_CALLS):
            ev("HINT")
        elif last in _DESC_CALLS:
            ev("DESC")
        elif isinstance(call.func, ast.Attribute) and call.func.attr in ("load", "store", "gather", "scatter") \
                and call.args and isinstance(call.args[0], (ast.List, ast.Tuple)):
            ev("DESC")  # desc.load([offsets]) / desc.store([offsets], value)
        elif isinstance(call.func, ast.Attribute) and call.func.attr == "store" and len(call.args) == 1 \
                and not call.keywords and self.kind == "gluon":
            recv = call.func.value
            if not (isinstance(recv, ast.Name) and recv.id in m.imports and recv.id not in self.local):
                ev("SMEM_STORE", roots=(self.root(recv),))
        elif isinstance(call.func, ast.Name) and call.func.id in m.jit and call.func.id not in self.local \
                and call.func.id not in m._in_progress:
            self._inline(call, out, first, lst)

    def _inline(self, call: ast.Call, out, first, lst):
        m = self.m
        name = call.func.id
        callee = m.func(name)
        inner = m.events(name)
        if any(isinstance(a, ast.Starred) for a in call.args):
            bound = {}
        else:
            bound = dict(zip(callee.positional, call.args))
        for k in call.keywords:
            if k.arg is not None:
                bound[k.arg] = k.value
        cid = m.new_call_id()
        cache: dict = {}

        def map_root(r):
            if r is None:
                return None
            if r in callee.params:
                if r not in cache:
                    cache[r] = self.root(bound[r]) if r in bound else None
                return cache[r]
            return f"{name}#{cid}:{r}"

        for h in inner:
            new = replace(h, line=call.lineno, first=min(first, call.lineno), last=max(lst, call.end_lineno),
                          roots=tuple(map_root(r) for r in h.roots), call=cid,
                          via=name + (f" -> {h.via}" if h.via else ""))
            if h.kind == "LS":
                args = [bound[p] for p in h.params if p in bound]
                ds = [self.deps(a) for a in args]
                new.below = h.below or h.bcast
                new.bcast = any(d[0] for d in ds)
                new.params = frozenset().union(*[d[1] for d in ds]) if ds else frozenset()
                new.bases = frozenset().union(*[self.bases(bound[p]) for p in h.bases if p in bound])
            out.append(new)


# ------------------------------------------------------------------------------------------------
# rules
# ------------------------------------------------------------------------------------------------
def _rules_for(mod: _Module, name: str) -> list[Finding]:
    fn, kind = mod.jit[name]
    f = mod.func(name)
    evs = mod.events(name)
    entry = not mod.callers.get(name)
    out: list[Finding] = []

    def add(rule, ev_or_line, msg):
        if isinstance(ev_or_line, _Ev):
            line, first, last = ev_or_line.line, ev_or_line.first, ev_or_line.last
        else:
            line, first, last = ev_or_line
        out.append(Finding(mod.path, line, rule, msg, first, last, name))

    def via(e):
        return f" (in {e.via})" if e.via else ""

    uses_desc = any(e.kind == "DESC" for e in evs)

    # TP001 (one finding per line, op and helper chain; masked if any of them is)
    if kind == "gluon" or not uses_desc:
        sites: dict = {}
        for e in evs:
            if e.kind == "LS" and e.bcast and not e.below:
                key = (e.line, e.op, e.via)
                if key in sites:
                    sites[key].masked = sites[key].masked or e.masked
                else:
                    sites[key] = replace(e)
        for e in sites.values():
            load = "load" in e.op or "global_to_shared" in e.op
            if kind == "gluon":
                fix = f"tma.{'async_copy_global_to_shared' if load else 'async_copy_shared_to_global'} would fit"
            else:
                fix = "a tensor descriptor (tl.make_tensor_descriptor) would fit"
            add("TP001", e, f"`{e.op}`{via(e)} {'loads' if load else 'stores'} a 2D+ tile through pointers with "
                            f"broadcast offsets{' and a mask' if e.masked else ''}; {fix}")

    # TP002
    pending: dict = {}
    for e in evs:
        if e.kind == "SMEM_STORE" and e.roots[0] is not None:
            pending.setdefault(e.roots[0], e)
        elif e.kind == "FENCE":
            pending.clear()
        elif e.kind in ("TMA_STORE", "WGMMA"):
            for r in e.roots:
                w = pending.get(r) if r is not None else None
                if w is not None and not (w.call is not None and w.call == e.call):
                    reader = "a TMA store" if e.kind == "TMA_STORE" else "warpgroup_mma"
                    add("TP002", e, f"{reader}{via(e)} reads shared memory `{_show(r)}` written by .store() at line "
                                    f"{w.line} with no fence_async_shared() in between")
                    pending.pop(r, None)

    # TP003
    for e in evs:
        if e.kind == "WAIT" and e.call is None and not e.used:
            add("TP003", e, "the result of warpgroup_mma_wait() is dropped; write "
                            "`acc = warpgroup_mma_wait(n, deps=[acc, ...])` and use what it returns")

    # TP004
    if entry:
        inits: dict = {}
        inval = {e.roots[0] for e in evs if e.kind == "MB_INVALIDATE"}
        for e in evs:
            if e.kind == "MB_INIT" and e.roots[0] is not None and e.roots[0] not in inits:
                inits[e.roots[0]] = e
        for r, e in inits.items():
            if r not in inval:
                add("TP004", e, f"mbarrier `{_show(r)}`{via(e)} is initialised but never mbarrier.invalidate()-d in "
                                f"this kernel")
    tma_bar: dict = {}
    mma_bar: dict = {}
    last_sig = None
    for i, e in enumerate(evs):
        if e.kind == "TMA_LOAD" and e.roots[1] is not None:
            tma_bar.setdefault(e.roots[1], (i, e))
        elif e.kind == "MMA_BAR" and e.roots[0] is not None:
            mma_bar.setdefault(e.roots[0], (i, e))
        elif e.kind == "MB_ARRIVE" and last_sig is not None and last_sig.kind == "WAIT" and e.roots[0] is not None:
            mma_bar.setdefault(e.roots[0], (i, e))
        if e.kind not in ("BAR", "FENCE"):
            last_sig = e
    for r in tma_bar.keys() & mma_bar.keys():
        (i1, e1), (i2, e2) = sorted([tma_bar[r], mma_bar[r]], key=lambda t: t[0])
        if e1.call is not None and e1.call == e2.call:
            continue
        add("TP004", e2, f"mbarrier `{_show(r)}` signals both TMA completion (line {tma_bar[r][1].line}) and MMA "
                         f"completion (line {mma_bar[r][1].line}); give each its own barrier")

    # TP005 (one finding per line)
    if kind == "gluon" and not mod.at_most_4_warps(name):
        operands = {r for e in evs if e.kind == "WGMMA" for r in e.roots if r is not None}
        warps = sorted({w for w in mod.warps.get(name, []) if w is not None})
        when = (f"it is launched with num_warps={'/'.join(map(str, warps))}" if warps and not mod.callers.get(name)
                else "no launch in this file shows num_warps <= 4")
        hits: dict = {}
        armed = None
        for e in evs:
            if e.kind == "WAIT":
                armed = e
            elif e.kind == "BAR":
                armed = None
            elif armed is not None and e.kind in ("TMA_LOAD", "CP_ASYNC", "SMEM_STORE") \
                    and e.roots[0] in operands and not (e.call is not None and e.call == armed.call):
                hits.setdefault(e.line, (e, armed, []))
                if e.roots[0] not in hits[e.line][2]:
                    hits[e.line][2].append(e.roots[0])
        for e, armed, roots in hits.values():
            how = {"TMA_LOAD": "a TMA load", "CP_ASYNC": "cp.async", "SMEM_STORE": ".store()"}[e.kind]
            bufs = ", ".join(f"`{_show(r)}`" for r in roots)
            add("TP005", e, f"{how}{via(e)} refills WGMMA operand {bufs} after warpgroup_mma_wait (line {armed.line}) "
                            f"with no gl.thread_barrier() in between; {when}")

    # TP006 (this function's own body)
    reported: set = set()
    for node in ast.walk(ast.Module(body=fn.body, type_ignores=[])):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in f.local \
                and node.id not in reported and node.id in mod.bindings:
            kinds = mod.bindings[node.id]
            if {"def", "import", "constexpr", "lang"} & kinds.keys():
                continue
            bad = [k for k in ("annotated", "import-const", "value") if k in kinds]
            if not bad:
                continue
            reported.add(node.id)
            at = kinds[bad[0]]
            if bad[0] == "annotated":
                msg = (f"kernel reads global `{node.id}` (line {at}) declared `{node.id}: constexpr = ...`, which "
                       f"triton 3.6 rejects; write `{node.id} = tl.constexpr(...)` or pass it as an argument")
            elif bad[0] == "import-const":
                msg = f"kernel reads `{node.id}`, imported at line {at} and named like a constant"
            else:
                msg = f"kernel reads module-level global `{node.id}` (assigned at line {at})"
            seg = (node.lineno, node.lineno, node.end_lineno)
            add("TP006", seg, msg)

    # TP007
    if kind == "triton" and entry and not uses_desc and not any(e.kind == "HINT" for e in evs):
        ptrs = set()
        for e in evs:
            if e.kind == "LS":
                ptrs |= set(e.bases)
        ptrs |= {p for p in f.params if _PTR_NAME.search(p)}
        ptrs = [p for p in f.params if p in ptrs and p not in f.constexpr_params]
        if ptrs:
            head = fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno
            shown = ", ".join(ptrs[:4]) + (", ..." if len(ptrs) > 4 else "")
            add("TP007", (fn.lineno, head, fn.lineno),
                f"Triton kernel `{name}` takes pointers ({shown}) but never uses tl.multiple_of / tl.max_contiguous")
    return out


def _show(root: str) -> str:
    return root.rsplit(":", 1)[-1]


# ------------------------------------------------------------------------------------------------
# suppressions
# ------------------------------------------------------------------------------------------------
@dataclass
class _Allow:
    line: int
    rules: set
    reason: str
    function: bool
    used: bool = False


def _suppressions(path: str, source: str) -> tuple[list[_Allow], list[Finding]]:
    allows: list[_Allow] = []
    bad: list[Finding] = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return allows, bad
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        mt = _SUPPRESS.search(tok.string)
        if not mt:
            continue
        line = tok.start[0]
        ma = _ALLOW.match(mt.group(1).strip())
        if not ma:
            bad.append(Finding(path, line, "TP000", f"malformed lint comment `{tok.string.strip()}`; expected "
                                                    "`# lint: allow TP00X -- reason`", line, line))
            continue
        ids = {x for x in re.split(r"[\s,]+", ma.group(2).strip()) if x}
        unknown = sorted(x for x in ids if x not in RULES or x == "TP000")
        reason = (ma.group(3) or "").strip()
        if any(not re.fullmatch(r"[A-Z]{2}\d{3}", x) for x in ids):
            bad.append(Finding(path, line, "TP000", f"malformed lint comment `{tok.string.strip()}`; expected "
                                                    "`# lint: allow TP00X -- reason`", line, line))
            continue
        if unknown:
            bad.append(Finding(path, line, "TP000", f"unknown rule id {', '.join(unknown)} in lint comment",
                               line, line))
            continue
        if not reason:
            bad.append(Finding(path, line, "TP000", f"suppression of {', '.join(sorted(ids))} gives no reason "
                                                    "(`-- why`); it suppresses nothing", line, line))
            continue
        allows.append(_Allow(line, ids, reason, ma.group(1) == "allow-function"))
    return allows, bad


def _apply(findings: list[Finding], allows: list[_Allow], headers: dict[str, tuple[int, int]]):
    for fd in findings:
        for a in allows:
            if fd.rule not in a.rules:
                continue
            if a.function:
                span = headers.get(fd.func or "")
                hit = span is not None and span[0] - 1 <= a.line <= span[1]
            else:
                hit = fd.first - 1 <= a.line <= fd.last
            if hit:
                fd.suppressed = a.reason
                a.used = True
                break


# ------------------------------------------------------------------------------------------------
# entry points
# ------------------------------------------------------------------------------------------------
def lint_source(source: str, path: str = "<string>") -> list[Finding]:
    """Every finding of one file's source, suppressed ones included (their `.suppressed` is the reason).

    Raises SyntaxError when the source does not parse."""
    tree = ast.parse(source, filename=path)
    mod = _Module(path, tree)
    findings: list[Finding] = []
    for name in mod.jit:
        findings.extend(_rules_for(mod, name))
    allows, bad = _suppressions(path, source)
    headers = {}
    for name, (fn, _) in mod.jit.items():
        top = min([d.lineno for d in fn.decorator_list] + [fn.lineno])
        body = fn.body[0].lineno - 1 if fn.body else fn.lineno
        headers[name] = (top, max(fn.lineno, body))
    seen = set()
    unique = []
    for fd in findings:
        key = (fd.line, fd.rule, fd.message)
        if key not in seen:
            seen.add(key)
            unique.append(fd)
    _apply(unique, allows, headers)
    out = unique + bad
    out.sort(key=lambda fd: (fd.line, fd.rule, fd.message))
    return out


def _files(paths) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files.extend(sorted(q for q in p.rglob("*.py") if "__pycache__" not in q.parts))
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(str(p))
    return files


def _display(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def lint_paths(paths) -> tuple[list[Finding], list[str]]:
    """(findings, errors) for files and folders (folders: every *.py below them)."""
    findings: list[Finding] = []
    errors: list[str] = []
    for f in _files(paths):
        try:
            source = f.read_text(encoding="utf-8")
            findings.extend(lint_source(source, _display(f)))
        except (SyntaxError, UnicodeDecodeError, ValueError) as exc:
            errors.append(f"{_display(f)}: cannot parse: {exc}")
    return findings, errors


def default_paths() -> list[Path]:
    return [Path(__file__).resolve().parent / "ops"]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("paths", nargs="*", help="files or folders (default: the installed tileport/ops)")
    parser.add_argument("--show-suppressed", action="store_true", help="also print suppressed findings")
    parser.add_argument("--list-rules", action="store_true", help="print the rules and exit")
    return parser


def main(args=None) -> int:
    """Run the checker. `args`: an argparse Namespace from `add_arguments`, or an argv list."""
    if args is None or isinstance(args, (list, tuple)):
        parser = add_arguments(argparse.ArgumentParser(prog="tileport lint", description=__doc__.split("\n")[0]))
        args = parser.parse_args(args)
    if getattr(args, "list_rules", False):
        for rid, (title, why) in RULES.items():
            print(f"{rid} {title} \u2014 {why}")
        return 0
    paths = args.paths or default_paths()
    try:
        findings, errors = lint_paths(paths)
    except FileNotFoundError as exc:
        print(f"tileport lint: no such file or folder: {exc}", file=sys.stderr)
        return 2
    shown = 0
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    for fd in findings:
        if fd.suppressed is None or args.show_suppressed:
            text = fd.format()
            try:
                text.encode(encoding)
            except (UnicodeEncodeError, LookupError):
                text = text.replace("\u2014", "--")
            print(text)
        shown += fd.suppressed is None
    for e in errors:
        print(e, file=sys.stderr)
    n_sup = sum(fd.suppressed is not None for fd in findings)
    print(f"tileport lint: {shown} finding(s), {n_sup} suppressed", file=sys.stderr)
    if errors:
        return 2
    return 1 if shown else 0


if __name__ == "__main__":
    sys.exit(main())
