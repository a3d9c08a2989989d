"""An mbarrier as the Gluon kernels use it, for the tests that model their handshakes in Python (the seesaw and balanced
mla_decode schedules, the persistent prefill): `count` arrivals complete a phase; wait(parity) passes once the phase of
that parity has completed (a fresh barrier counts as having completed the phase before 0, of parity 1)."""

from __future__ import annotations

import random


class Barrier:
    def __init__(self, count: int):
        self.count, self.pending, self.completed = count, 0, 0

    def arrive(self):
        self.pending += 1
        assert self.pending <= self.count, "more arrivals than the barrier's count in one phase"
        if self.pending == self.count:
            self.pending, self.completed = 0, self.completed + 1

    def passed(self, parity: int) -> bool:
        return (self.completed & 1) != parity


def run_interleaved(kernel, actors: dict, seed: int, context: str) -> None:
    """Runs the partitions (`actors`: name -> generator yielding the condition it waits on next) and the kernel's copies
    in flight (`kernel.in_flight`, landed by `kernel.land(copy)`) in a random interleaving until all finish; a state where
    nothing can run is a deadlock (an AssertionError naming `context`)."""
    rng = random.Random(seed)
    waiting = {name: (lambda: True) for name in actors}
    while actors or kernel.in_flight:
        runnable = [name for name in actors if waiting[name]()]
        choices = runnable + [("land", t) for t in kernel.in_flight]
        assert choices, f"deadlock: {sorted(actors)} wait, no copy in flight ({context}, seed {seed})"
        pick = rng.choice(choices)
        if isinstance(pick, tuple):
            kernel.land(pick[1])
            continue
        try:
            waiting[pick] = next(actors[pick])
        except StopIteration:
            del actors[pick]
