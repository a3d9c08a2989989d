"""An mbarrier as the Gluon kernels use it, for the tests that model their handshakes in Python (the seesaw and balanced
mla_decode schedules, the persistent prefill): `count` arrivals complete a phase; wait(parity) passes once the phase of
that parity has completed (a fresh barrier counts as having completed the phase before 0, of parity 1)."""

from __future__ import annotations


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
