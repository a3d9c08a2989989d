"""The handshakes of the seesaw schedule (mla_decode_gluon_seesaw.py, with mla_decode_gluon.py's loader), modelled on the
CPU: the loader and the two attention warpgroups as coroutines over mbarriers with PTX's phase-parity waits, the TMA
copies landing at random later steps, every interleaving chosen at random. For 0 to 7 tiles in both orders ("seesaw"
and "seesaw_early_release"): no deadlock, no stage refilled while a warpgroup still reads it, every read sees the tile
it expects, landed, and the one p buffer and maxima slot are rewritten only after the other warpgroup has read them.
A model of the kernel's waits and arrivals as its code makes them (kept beside it: a change to one is a change to the
other), not the kernel: that runs on a GPU only (tests/cuda/test_mla_decode_gluon.py)."""

from __future__ import annotations

import pytest
from mbarrier_model import Barrier, run_interleaved


class Kernel:
    def __init__(self, num_tiles: int):
        self.n = num_tiles
        self.ready = [Barrier(1), Barrier(1)]
        self.empty = [Barrier(2), Barrier(2)]
        self.published = [Barrier(1), Barrier(1)]
        self.sums = Barrier(2)
        self.stage = [None, None]  # the tile each stage holds
        self.landed = [False, False]
        self.readers = [set(), set()]  # warpgroups whose wgmmas may still read the stage
        self.in_flight = []  # stages whose TMA copies have not landed
        self.p_tile = None  # the tile whose p (and maxima) the buffer holds
        self.p_read_by_other = True  # the other warpgroup has taken it in
        self.taken_in = {0: [], 1: []}

    def read(self, w: int, t: int, tile: int):
        assert self.stage[t] == tile and self.landed[t], (w, t, tile, self.stage, self.landed)
        self.readers[t].add(w)

    def done(self, w: int, t: int):
        self.readers[t].discard(w)

    def loader(self):
        for j in range(self.n):
            t = j % 2
            yield lambda t=t, j=j: self.empty[t].passed(((j // 2) & 1) ^ 1)
            assert not self.readers[t], (j, self.readers)
            self.stage[t], self.landed[t] = j, False
            self.in_flight.append(t)

    def land(self, t: int):
        self.in_flight.remove(t)
        self.landed[t] = True
        self.ready[t].arrive()

    def publish(self, w: int, j: int):
        assert self.p_read_by_other, (w, j, self.p_tile)
        self.p_tile, self.p_read_by_other = j, False
        self.published[w].arrive()

    def take_in(self, w: int, k: int):
        """_take_in: the other's publication of tile k waited for, its p . v issued (the stage and p read)."""
        o = 1 - w
        yield lambda: self.published[o].passed((k // 2) & 1)
        assert self.p_tile == k, (w, k, self.p_tile)
        self.read(w, k % 2, k)
        self.taken_in[w].append(k)

    def took_in(self, w: int, k: int):
        """Its p . v done: the stage released by w, the p buffer read."""
        self.done(w, k % 2)
        self.p_read_by_other = True
        self.empty[k % 2].arrive()

    def own_tile(self, w: int, j: int):
        """The scores of own tile j (its stage waited for), then (after the softmax) p_j published and its p . v."""
        t = j % 2
        yield lambda: self.ready[t].passed((j // 2) & 1)
        self.read(w, t, j)
        yield lambda: True
        self.done(w, t)
        self.publish(w, j)
        self.read(w, t, j)
        yield lambda: True
        self.done(w, t)
        self.empty[t].arrive()

    def take_in_whole(self, w: int, k: int):
        yield from self.take_in(w, k)
        yield lambda: True
        self.took_in(w, k)

    def attend(self, w: int, early_release: bool):
        n = self.n
        if early_release:
            # the other's next tile after each own tile, before the next own stage is waited for
            if w == 1 and n > 0:
                yield from self.take_in_whole(w, 0)
            for j in range(w, n, 2):
                yield from self.own_tile(w, j)
                if j + 1 < n:
                    yield from self.take_in_whole(w, j + 1)
        else:
            if w == 0 and n > 0:
                yield from self.own_tile(w, 0)
            for j in range(2 - w, n, 2):
                t = j % 2
                yield lambda t=t, j=j: self.ready[t].passed((j // 2) & 1)
                self.read(w, t, j)  # the scores in flight
                yield from self.take_in(w, j - 1)
                yield lambda: True
                self.done(w, t)  # the scores done (the softmax runs)
                yield lambda: True
                self.took_in(w, j - 1)
                self.publish(w, j)
                self.read(w, t, j)  # its own p . v
                yield lambda: True
                self.done(w, t)
                self.empty[t].arrive()
            if n > 0 and (n - 1) % 2 == 1 - w:
                yield from self.take_in_whole(w, n - 1)
        self.sums.arrive()
        yield lambda: self.sums.passed(0)


def _run(num_tiles: int, early_release: bool, seed: int):
    k = Kernel(num_tiles)
    actors = {"loader": k.loader(), "w0": k.attend(0, early_release), "w1": k.attend(1, early_release)}
    run_interleaved(k, actors, seed, f"tiles {num_tiles}")
    # each warpgroup took in every tile of the other's, in order
    assert k.taken_in[0] == list(range(1, num_tiles, 2)) and k.taken_in[1] == list(range(0, num_tiles, 2))
    assert all(b.pending == 0 for b in k.empty + k.ready + k.published)


@pytest.mark.parametrize("early_release", [False, True])
@pytest.mark.parametrize("num_tiles", range(8))
def test_the_seesaw_handshakes_neither_deadlock_nor_race(num_tiles, early_release):
    for seed in range(200):
        _run(num_tiles, early_release, seed)
