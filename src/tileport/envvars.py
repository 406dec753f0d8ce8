"""Environment variables read on every op call (backend choice, the interpreter, poisoning).

`os.environ.get` costs ~1 us in CPython (it encodes the key and decodes the value through the
Mapping machinery), and one RMSNorm forward+backward read 18 of them (CPU profile, 2026-11-29).
On POSIX CPython `os.environ` keeps its data in a dict of bytes (`_data`) that every `os.environ`
write updates, so a lookup there sees the same values at a tenth of the cost; elsewhere this
falls back to `os.environ.get`. Values are always read at call time, never cached, so a test or
a user that changes a variable mid-run is honoured.
"""

from __future__ import annotations

import os

__all__ = ["getenv"]

_DATA = getattr(os.environ, "_data", None)
_KEYS: dict[str, bytes] = {}
if not (isinstance(_DATA, dict) and os.name == "posix"):
    _DATA = None


def getenv(name: str, default: str | None = None) -> str | None:
    """os.environ.get(name, default)."""
    if _DATA is None:
        return os.environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = os.fsencode(name)
    value = _DATA.get(key)
    return default if value is None else os.fsdecode(value)
