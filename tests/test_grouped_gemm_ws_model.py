"""The warp-specialized grouped GEMM forward's schedule (ring slots, mbarrier phases, descriptor
rings, staging buffers) in the Python model of tests/grouped_gemm_ws_model.py: random
interleavings of one program's producer and two consumers, for ring depths 2-4 (the kernel's is
4), 1-5 K steps per item (1 and 2: every step of an item in flight beside the next ones) and 1-9
items per program. CPU only; the kernel itself runs in tests/test_llm_ops_gluon.py on the GPU."""

from __future__ import annotations

import random

import pytest
from grouped_gemm_ws_model import Model, ScheduleError, check


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("nk", [1, 2, 3, 5])
@pytest.mark.parametrize("n_items", [1, 2, 3, 9])
def test_schedule_has_no_deadlock_or_race(stages, nk, n_items):
    check(stages, nk, n_items, seeds=40)


@pytest.mark.parametrize("bug", ["early_release", "no_parity_flip", "short_descriptor_ring"])
def test_model_catches_a_broken_schedule(bug):
    """The model is not vacuous: a release before the product that read the slot has retired (a
    race on the slot), a wait on the wrong parity (the producer blocks on fresh barriers: a
    deadlock) and an operand-descriptor ring one slot short (rewritten under a load when items
    are one K step long) are each caught."""
    with pytest.raises(ScheduleError):
        for seed in range(200):
            Model(4, 1, 8, random.Random(seed), bug=bug).run()
