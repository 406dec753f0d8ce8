"""Backend dispatch: each call goes to the best backend that accepts it, and every refusal has a reason.

An op registers its backends in preference order. Each backend answers two questions with
either None (yes) or a sentence a user can read (no):
    available()      can this machine run it at all (imports, device capability)?
    refusal(call)    does it accept this particular call (dtype, sizes, alignment, device)?

Environment (read on every call, so tests and users can flip them at run time):
    TILEPORT_BACKEND=<name>          force one backend for every op
    TILEPORT_<OP>_BACKEND=<name>     force one backend for one op (wins over the global one)
    TILEPORT_DISABLE=<a,b>           never use these backends
    TILEPORT_STRICT=1                a fallback (a preferred backend skipped) is an error
A forced backend that refuses raises `BackendRefused` with its reason: no silent fallback.

Decisions are cached per call signature, so a steady-state call costs one dict lookup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Hashable
from typing import Any

from tileport.envvars import getenv

class BackendRefused(RuntimeError):
    """Raised when a forced backend refuses a call, or when strict mode forbids a fallback."""


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    available: Callable[[], str | None]
    refusal: Callable[[Any], str | None]
    impl: Any  # op-specific object holding the stage functions
    devices: tuple[str, ...] = ("cuda",)  # device types this backend is meant for


@dataclasses.dataclass(frozen=True)
class Verdict:
    backend: str
    applies: bool  # meant for this device type
    unavailable: str | None
    refused: str | None

    @property
    def ok(self) -> bool:
        return self.applies and self.unavailable is None and self.refused is None

    def reason(self) -> str | None:
        if not self.applies:
            return "not a backend for this device"
        return self.unavailable or self.refused


_local = threading.local()


def _forced_override() -> dict[str, str]:
    return getattr(_local, "forced", {})


@contextlib.contextmanager
def use_backend(name: str, op: str | None = None):
    """Force `name` for `op` (or all ops) inside the block; same rules as TILEPORT_BACKEND."""
    before = dict(_forced_override())
    forced = dict(before)
    forced[op or "*"] = name
    _local.forced = forced
    try:
        yield
    finally:
        _local.forced = before


def forced_backends() -> dict[str, str]:
    """This thread's `use_backend` settings (op or "*" -> backend), a copy."""
    return dict(_forced_override())


@contextlib.contextmanager
def backends_forced_as(forced: dict[str, str]):
    """Run the block with this thread's `use_backend` settings replaced by `forced` (what
    `forced_backends` returned on another thread: autograd runs a CUDA backward on its own device
    thread, where the forward's thread-local settings are absent; tileport.autograd_ops carries them
    over)."""
    before = _forced_override()
    _local.forced = dict(forced)
    try:
        yield
    finally:
        _local.forced = before


def interpreter_enabled() -> bool:
    return getenv("TRITON_INTERPRET", "0") == "1"


def _not_meant_for(backend: str, device_type: str) -> str:
    """Why a backend does not apply to a device, for `explain`."""
    if backend == "triton":
        return ("Triton runs on the CPU only under TRITON_INTERPRET=1 (set it to run the Triton kernels "
                "in the interpreter; slow, for testing)")
    if backend == "gluon":
        return f"the Gluon kernels need an NVIDIA Hopper GPU (sm_90: TMA, WGMMA); this call is on {device_type}"
    if backend == "cutile":
        return (f"the cuTile kernels need a CUDA GPU of sm_90 or newer; this call is on {device_type} (here they are "
                "only compiled: tests/test_cutile_compile.py)")
    return f"not meant for {device_type}"


class OpDispatcher:
    """Chooses a backend for one op. `signature(call)` must return a hashable key of everything
    the backends' refusals depend on (dtype, device, sizes, alignment...)."""

    def __init__(self, op: str, backends: list[Backend], signature: Callable[[Any], Hashable]):
        self.op = op
        self.backends = backends
        self.signature = signature
        self._by_name = {b.name: b for b in backends}
        self._cache: dict[Hashable, Backend] = {}
        self._available: dict[str, str | None] = {}
        self._settings_cache: dict[tuple, tuple[str | None, frozenset[str], bool]] = {}
        self._op_env = f"TILEPORT_{op.upper()}_BACKEND"

    # -- settings --------------------------------------------------------------------------
    def _settings(self) -> tuple[str | None, frozenset[str], bool]:
        forced = _forced_override()
        raw = (
            tuple(sorted(forced.items())) if forced else (),
            getenv(self._op_env),
            getenv("TILEPORT_BACKEND"),
            getenv("TILEPORT_DISABLE", ""),
            getenv("TILEPORT_STRICT", "0"),
        )
        hit = self._settings_cache.get(raw)
        if hit is None:
            hit = self._settings_cache[raw] = self._parse_settings(*raw)
        return hit

    def _parse_settings(self, forced_ctx, op_env, global_env, disable_env, strict_env):
        forced_ctx = dict(forced_ctx)
        forced = forced_ctx.get(self.op) or forced_ctx.get("*") or op_env or global_env or None
        disabled = frozenset(x.strip() for x in disable_env.split(",") if x.strip())
        strict = strict_env == "1"
        if forced is not None and forced not in self._by_name:
            raise BackendRefused(
                f"{self.op}: unknown backend {forced!r} forced; known: {', '.join(self._by_name)}"
            )
        return forced, disabled, strict

    def availability(self, backend: Backend) -> str | None:
        if backend.name not in self._available:
            try:
                self._available[backend.name] = backend.available()
            except Exception as exc:  # an import error is a reason, not a crash
                self._available[backend.name] = f"{type(exc).__name__}: {exc}"
        return self._available[backend.name]

    @staticmethod
    def _applies(backend: Backend, device_type: str) -> bool:
        if device_type == "cpu" and backend.name == "triton":
            return interpreter_enabled()
        return device_type in backend.devices

    # -- decisions -------------------------------------------------------------------------
    def verdicts(self, call, device_type: str, disabled: frozenset[str] = frozenset()) -> list[Verdict]:
        out = []
        for b in self.backends:
            applies = self._applies(b, device_type)
            unavailable = refused = None
            if applies:
                unavailable = self.availability(b)
                if unavailable is None and b.name in disabled:
                    unavailable = "disabled by TILEPORT_DISABLE"
                if unavailable is None:
                    refused = b.refusal(call)
            out.append(Verdict(b.name, applies, unavailable, refused))
        return out

    def choose(self, call, device_type: str) -> Backend:
        forced, disabled, strict = self._settings()
        key = (self.signature(call), device_type, forced, disabled, strict, interpreter_enabled())
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        chosen = self._decide(call, device_type, forced, disabled, strict)
        self._cache[key] = chosen
        return chosen

    def _decide(self, call, device_type, forced, disabled, strict) -> Backend:
        if forced is not None:
            b = self._by_name[forced]
            if not self._applies(b, device_type):
                raise BackendRefused(
                    f"{self.op}: backend {forced!r} was forced but does not run on {device_type}"
                    + (" (set TRITON_INTERPRET=1 to run Triton on the CPU)" if b.name == "triton" else "")
                )
            reason = self.availability(b) or b.refusal(call)
            if reason:
                raise BackendRefused(f"{self.op}: forced backend {forced!r} refuses this call: {reason}")
            return b
        skipped = []
        for v in self.verdicts(call, device_type, disabled):
            if not v.applies:
                continue
            if v.ok:
                if strict and skipped:
                    raise BackendRefused(
                        f"{self.op}: TILEPORT_STRICT=1 and the preferred backend(s) were skipped: "
                        + "; ".join(f"{n}: {r}" for n, r in skipped)
                    )
                return self._by_name[v.backend]
            skipped.append((v.backend, v.reason()))
        raise BackendRefused(
            f"{self.op}: no backend accepts this call: " + "; ".join(f"{n}: {r}" for n, r in skipped)
        )

    def explain(self, call, device_type: str) -> str:
        """A table of every backend: meant for this device, available, accepts, and which one runs."""
        forced, disabled, strict = self._settings()
        try:
            chosen = self._decide(call, device_type, forced, disabled, strict).name
            failure = None
        except BackendRefused as exc:
            chosen, failure = None, str(exc)
        lines = [f"op {self.op} on {device_type}" + (f" (forced: {forced})" if forced else "") + (" [strict]" if strict else "")]
        for v in self.verdicts(call, device_type, disabled):
            mark = "->" if v.backend == chosen else "  "
            if not v.applies:
                status = "n/a      " + _not_meant_for(v.backend, device_type)
            elif v.unavailable:
                status = f"no       unavailable: {v.unavailable}"
                try:  # say what it would do on a machine where it is available
                    would = self._by_name[v.backend].refusal(call)
                    status += f"; would refuse: {would}" if would else "; would accept this call"
                except Exception:
                    pass
            elif v.refused:
                status = f"no       refuses: {v.refused}"
            else:
                status = "yes      accepts"
            lines.append(f" {mark} {v.backend:<10} {status}")
        lines.append(f"runs: {chosen}" if chosen else f"error: {failure}")
        return "\n".join(lines)


def lazy_stages(module: str, forward: str, backward: str):
    """A backend's `impl` whose stage functions live in `module`, imported on first call (so a
    backend whose module needs a GPU toolchain costs nothing until it is chosen)."""
    import importlib
    from types import SimpleNamespace

    resolved: dict[str, Callable] = {}

    def stage(name: str) -> Callable:
        def call(*args, **kwargs):
            fn = resolved.get(name)
            if fn is None:
                fn = resolved[name] = getattr(importlib.import_module(module), name)
            return fn(*args, **kwargs)

        return call

    return SimpleNamespace(forward=stage(forward), backward=stage(backward))


def triton_available(module: str) -> Callable[[], str | None]:
    """The availability check every Triton backend shares: its module imports, and there is a
    CUDA device or the interpreter is on."""

    def available() -> str | None:
        import importlib

        import torch

        importlib.import_module(module)  # an import error becomes the reason (OpDispatcher.availability)
        if not torch.cuda.is_available() and not interpreter_enabled():
            return "no CUDA device (and TRITON_INTERPRET is not 1)"
        return None

    return available


def gluon_available(module: str) -> Callable[[], str | None]:
    """The availability check every Gluon (Hopper) backend shares: its module imports with Gluon
    present (the module's `_GLUON_ERROR` says why not), and the device is an sm_90 GPU."""

    def available() -> str | None:
        import importlib

        import torch

        error = getattr(importlib.import_module(module), "_GLUON_ERROR", None)
        if error is not None:
            return error
        if not torch.cuda.is_available():
            return "no CUDA device"
        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):
            return f"the Gluon kernels are written for Hopper (sm_90); this device is sm_{cap[0]}{cap[1]}"
        return None

    return available


def reference_backend(forward: Callable, backward: Callable) -> Backend:
    """The float64 reference: always available, accepts every call, on any device."""
    from types import SimpleNamespace

    return Backend("reference", lambda: None, lambda call: None,
                   SimpleNamespace(forward=forward, backward=backward), devices=("cuda", "cpu"))


def capability_refusal(device_type: str, capability, minimum=(8, 0)) -> str | None:
    if device_type == "cuda" and capability is not None and tuple(capability) < tuple(minimum):
        return (f"needs compute capability {minimum[0]}.{minimum[1]} or newer, "
                f"this device has {capability[0]}.{capability[1]}")
    return None


def kernel_dtype_and_capability_refusal(dtype, device_type: str, capability, min_capability=(8, 0)) -> str | None:
    """The refusal every Triton backend shares: kernel dtypes only, and a recent enough GPU."""
    import torch

    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"{dtype} is not a kernel dtype (bfloat16, float16, float32)"
    return capability_refusal(device_type, capability, min_capability)


REGISTRY: dict[str, OpDispatcher] = {}


def register(dispatcher: OpDispatcher) -> OpDispatcher:
    REGISTRY[dispatcher.op] = dispatcher
    return dispatcher
