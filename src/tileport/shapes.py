"""Integer helpers for host code (launch grids, block sizes).

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions in triton 3.6: called from
Python they go through the JIT's argument unwrapping and cost 3-4 us each (measured on the CPU
machine, 2026-11-29), several times per op call; these are plain integer arithmetic.
"""

from __future__ import annotations

__all__ = ["cdiv", "next_pow2"]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative a and positive b."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n for n >= 1, and 0 for 0: what triton.next_power_of_2 returns."""
    n = int(n)
    return 0 if n == 0 else 1 << (n - 1).bit_length()
