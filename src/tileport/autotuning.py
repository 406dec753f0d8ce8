"""Autotune candidates shared by the Triton backends.

A candidate is a dict of the kernel's block constexprs plus `num_warps` and `num_stages`. On a GPU
every candidate is timed by `triton.autotune` at the first call of a new key and the fastest kept:
which block shape and how many stages hide a kernel's latency best is a measurement on the card,
not a guess here. Under the interpreter, which cannot time anything, only the first candidate is
kept; each op's tests run the others by making them the only config (e.g. tests/test_gdn_tuning.py).
"""

from __future__ import annotations

import triton

from tileport.dispatch import interpreter_enabled


def configs(options) -> list:
    """triton.Config for each candidate dict."""
    launch = ("num_warps", "num_stages", "maxnreg")  # maxnreg: a cap on registers per thread (ptxas), for occupancy
    return [triton.Config({k: v for k, v in o.items() if k not in launch},
                          num_warps=o["num_warps"], num_stages=o["num_stages"], maxnreg=o.get("maxnreg"))
            for o in options]


def tuned(options) -> list:
    """The autotuner's candidates: all of them on a GPU, the first under the interpreter."""
    cs = configs(options)
    return cs[:1] if interpreter_enabled() else cs
