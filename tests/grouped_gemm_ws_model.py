"""A Python model of the warp-specialized grouped GEMM forward's schedule (gluon_kernels.py,
`_grouped_gemm_fwd_ws_kernel`; docs/perf/llm_ops.md row 8): one producer, two consumer warpgroups,
a ring of STAGES slots with a ready and an empty mbarrier each, the producer's ring of operand
descriptors and each consumer's ring of C descriptors and its staging buffer.

Each partition is a generator that runs the kernel's steps in the kernel's order and yields a
predicate when it must wait (an mbarrier wait, a store_wait); the asynchronous agents (a TMA load
landing, a TMA store having read its staging buffer out) are events. `run` picks, at random, one
runnable partition or one pending event at a time, so a seed is one interleaving. It raises
`ScheduleError` on:
- a deadlock (nothing runnable, no event pending, work left);
- a wait that passes on the wrong phase (the parity test passing one phase early or late);
- an empty barrier's phase completed by arrivals that are not one from each consumer for the
  same ring step;
- a race on a ring slot (a load into a slot while a product that reads it is not retired, or a
  product started while a load into its slot is in flight), or a product reading the wrong step;
- a descriptor slot rewritten while a load (operand descriptors) or a store (C descriptors) that
  uses it is in flight; a staging buffer written while a store reads it.
What it takes from the hardware: an mbarrier phase completes when its expected arrivals and
transaction bytes are in; a wait on parity p passes when the current phase's parity is not p (a
fresh barrier passes a wait on parity 1); a WGMMA reads its operands between its issue and its
retirement (wait_group), and the warpgroup's arrive follows its retirement (the kernel's
warpgroup barrier before the arrive); a TMA store is done with its descriptor once it has read
its source out (what store_wait waits for; the single-partition kernel assumes the same).
"""

from __future__ import annotations

import random


class ScheduleError(AssertionError):
    pass


class Barrier:
    def __init__(self, name, count):
        self.name, self.count = name, count
        self.arrivals, self.tx, self.phase = [], 0, 0
        self.history = []  # the arrivals that completed each phase

    def passes(self, parity):
        return (self.phase & 1) != parity

    def arrive(self, who, tx=0):
        self.tx += tx
        self.arrivals.append(who)
        self._check()

    def complete_tx(self, n):
        self.tx -= n
        if self.tx < 0:
            raise ScheduleError(f"{self.name}: more bytes landed than expected")
        self._check()

    def _check(self):
        if len(self.arrivals) > self.count:
            raise ScheduleError(f"{self.name}: {len(self.arrivals)} arrivals in a phase of {self.count}")
        if len(self.arrivals) == self.count and self.tx == 0:
            self.history.append(tuple(self.arrivals))
            self.arrivals, self.phase = [], self.phase + 1


class Model:
    def __init__(self, stages, nk, n_items, rng, bug=None):
        """bug: None (the kernel's schedule), or one deliberate mistake the model must catch:
        "early_release" (a consumer arrives on a slot's empty barrier right after starting its
        product, before retiring it), "no_parity_flip" (the producer waits on the empty
        barriers' parity without the flip), "short_descriptor_ring" (operand descriptors in a
        ring of STAGES - 1 slots)."""
        self.S, self.nk, self.n_items, self.rng, self.bug = stages, nk, n_items, rng, bug
        self.ready = [Barrier(f"ready[{s}]", 1) for s in range(stages)]
        self.empty = [Barrier(f"empty[{s}]", 2) for s in range(stages)]
        self.slot = [None] * stages  # the (item, k step) whose tiles a slot holds
        self.loads = []  # in flight: (slot, tag, descriptor slot)
        self.mma = {0: [], 1: []}  # per consumer: unretired products, (slot, step)
        self.stores = {0: [], 1: []}  # per consumer: stores not read out, C descriptor slot
        self.events = []
        self.consumed = {0: [], 1: []}

    # -- the producer partition ---------------------------------------------------------------
    def wait(self, bar, parity, want_phase, what):
        yield lambda: bar.passes(parity)
        if bar.phase != want_phase:
            raise ScheduleError(f"{what}: passed {bar.name} at phase {bar.phase}, meant {want_phase}")

    def producer(self):
        S, j = self.S, 0
        for i in range(self.n_items):
            yield from self.wait(self.empty[j % S], self.empty_parity(j), j // S, f"producer step {j}")
            ring = S - 1 if self.bug == "short_descriptor_ring" else S
            desc = "own" if i == 0 else i % ring  # item 0's descriptors have their own slot
            if i > 0 and any(d == desc for _, _, d in self.loads):
                raise ScheduleError(f"producer item {i}: descriptor slot {desc} rewritten under a load")
            self.issue_load(j, (i, 0), desc)
            for kk in range(1, self.nk):
                step = j + kk
                yield from self.wait(self.empty[step % S], self.empty_parity(step), step // S, f"producer step {step}")
                self.issue_load(step, (i, kk), desc)
            j += self.nk

    def empty_parity(self, step):
        return (step // self.S) & 1 if self.bug == "no_parity_flip" else ((step // self.S) & 1) ^ 1

    def issue_load(self, step, tag, desc):
        s = step % self.S
        for h in (0, 1):
            if any(ms == s for ms, _ in self.mma[h]):
                raise ScheduleError(f"load of step {step} into slot {s} while consumer {h} reads it")
        self.ready[s].arrive(("producer", step), tx=1)  # expect + arrive, then the copies
        entry = (s, tag, desc)
        self.loads.append(entry)
        self.events.append(("land", entry))

    # -- a consumer partition -----------------------------------------------------------------
    def consumer(self, h):
        S, j = self.S, 0
        for i in range(self.n_items):
            for kk in range(self.nk):
                step = j + kk
                s = step % S
                yield from self.wait(self.ready[s], (step // S) & 1, step // S + 1, f"consumer {h} step {step}")
                if self.slot[s] != (i, kk) or any(ls == s for ls, _, _ in self.loads):
                    raise ScheduleError(f"consumer {h} step {step}: slot {s} holds {self.slot[s]}, meant {(i, kk)}")
                self.mma[h].append((s, step))
                self.consumed[h].append((i, kk))
                if self.bug == "early_release":  # this step's slot, its product still running
                    self.empty[s].arrive((h, step))
                    yield lambda: True  # (the others may run before this warpgroup's wait_group)
                self.mma[h][:-1] = []  # wait_group(1): all but the newest retired
                if kk > 0 and self.bug != "early_release":  # the release of step - 1's slot
                    self.empty[(step - 1) % S].arrive((h, step - 1))
                if kk == 0:
                    desc = "own" if i == 0 else i % 2  # this item's C descriptor, after its first product
                    if i > 0 and desc in self.stores[h]:
                        raise ScheduleError(f"consumer {h} item {i}: C descriptor slot {desc} rewritten under a store")
                    cdesc = desc
            self.mma[h] = []  # wait_group(0)
            if self.bug != "early_release":
                self.empty[(j + self.nk - 1) % S].arrive((h, j + self.nk - 1))
            for _half in range(2):  # the epilogue: store_wait(0), stage, store
                yield lambda: not self.stores[h]
                self.stores[h].append(cdesc)
                self.events.append(("read_out", h))
            j += self.nk
        yield lambda: not self.stores[h]  # the final store_wait(0)

    # -- the scheduler ------------------------------------------------------------------------
    def fire(self, event):
        kind, what = event
        if kind == "land":
            self.loads.remove(what)
            s, tag, _ = what
            self.slot[s] = tag
            self.ready[s].complete_tx(1)
        else:  # a store of consumer `what` has read its staging buffer out (the oldest first)
            self.stores[what].pop(0)

    def run(self):
        agents = {"producer": self.producer(), 0: self.consumer(0), 1: self.consumer(1)}
        blocked = {name: (lambda: True) for name in agents}
        while agents or self.events:
            runnable = [name for name in agents if blocked[name]()]
            choices = [("agent", n) for n in runnable] + [("event", e) for e in self.events]
            if not choices:
                raise ScheduleError(f"deadlock: {sorted(map(str, agents))} wait, no event pending")
            kind, what = self.rng.choice(choices)
            if kind == "event":
                self.events.remove(what)
                self.fire(what)
                continue
            try:
                blocked[what] = next(agents[what])
            except StopIteration:
                del agents[what]
        want = [(i, kk) for i in range(self.n_items) for kk in range(self.nk)]
        for h in (0, 1):
            if self.consumed[h] != want:
                raise ScheduleError(f"consumer {h} consumed {self.consumed[h]}")
        for s, bar in enumerate(self.empty):  # every phase of an empty barrier: both consumers, one step
            for arrivals in bar.history:
                if sorted(a[0] for a in arrivals) != [0, 1] or len({a[1] for a in arrivals}) != 1:
                    raise ScheduleError(f"empty[{s}] completed by {arrivals}")


def check(stages, nk, n_items, seeds):
    """Run `seeds` random interleavings of one program's schedule; raise on the first violation."""
    for seed in range(seeds):
        Model(stages, nk, n_items, random.Random(seed)).run()
