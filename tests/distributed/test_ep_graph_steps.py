"""CUDA-graph steps with expert parallelism, without a GPU: the per-step agreement of the ranks
(DataParallelStream), the token bound a step's dispatches get, and what keeps a captured forward's
buffers in step with the other ranks (every forward starts on buffer parity 0)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer.distributed.expert_parallel import ExpertParallel, token_bound
from deepinfer.engine import data_parallel


class FakeEngine:
    """What DataParallelStream drives: a plan of steps, each a batch whose graph bucket index it
    names (None: not replayable), and the graphs it has captured."""

    def __init__(self, plan: list[int | None], buckets: list[int] | None):
        self.plan = list(plan)
        self.ep_graph_buckets = buckets
        self.runtime = SimpleNamespace(device=torch.device("cpu"))
        self.num_prompt_tokens_computed = self.num_generated_tokens = 0
        self.ran: list[tuple[str, int]] = []
        self.captured: set[int] = set()
        self.before = 0

    def has_unfinished(self):
        return bool(self.plan)

    def schedule(self):
        return SimpleNamespace(bucket=self.plan[0])

    def replayable(self, batch):
        return batch is None or batch.bucket is not None

    def graph_bucket(self, batch):
        return None if batch is None else batch.bucket

    def ensure_graph(self, size):
        if size not in self.captured:
            self.captured.add(size)
            self.ran.append(("capture", size))

    def before_step(self):
        self.before += 1

    def execute(self, batch, graph_size):
        self.plan.pop(0)
        self.ran.append(("step", graph_size))
        return []

    def idle_step(self, graph_size):
        self.before += 1
        self.ran.append(("idle", graph_size))

    def abort_all(self):  # the stream's clean-up: this fake holds no requests to drop
        pass


BUCKETS = [1, 2, 4, 8, 16]


def run_with_peer(monkeypatch, mine: list, peer: list, buckets=BUCKETS):
    """Run this rank's stream while a simulated peer contributes its flags. A step of either is a
    bucket index (a replayable decode batch), "eager" (a prefill) or None (idle); after its list
    the peer is idle."""
    steps = iter(peer)

    def all_reduce(flags, group=None):
        p = next(steps, None)
        add = torch.zeros_like(flags)
        add[0], add[2] = int(p is not None), int(p == "eager")
        if isinstance(p, int) and buckets:
            add[data_parallel.STEP_FLAGS + p] = 1
        flags += add

    monkeypatch.setattr(data_parallel.dist, "all_reduce", all_reduce)
    engine = FakeEngine([None if m == "eager" else m for m in mine], buckets)
    ctx = SimpleNamespace(rank=1, world_size=2, backend="gloo", group=None, timeout_s=5.0)
    list(data_parallel.DataParallelStream(engine, ctx, {}, 0, use_tqdm=False))
    return engine


def test_every_rank_replays_the_largest_graph_of_the_step(monkeypatch):
    engine = run_with_peer(monkeypatch, [1, 3, "eager", 2, 0], [3, 1, 1, None, "eager", 4])
    assert engine.ran == [
        ("capture", 8), ("step", 8),  # this rank's 2 sequences ride the peer's graph of 8 (captured together, first time)
        ("step", 8),  # the peer's 2 in this rank's graph of 8 (already captured)
        ("step", 0),  # this rank prefills: eager on both
        ("capture", 4), ("step", 4),  # the peer idle: it replays the graph of 4 with padding only
        ("step", 0),  # the peer prefills
        ("capture", 16), ("idle", 16),  # this rank idle, replaying the peer's graph of 16 with padding
    ]
    assert engine.before == 6  # once per step on every rank, idle ones included


def test_without_graphs_every_step_is_eager(monkeypatch):
    engine = run_with_peer(monkeypatch, [0, 0], [0, 0], buckets=None)
    assert engine.ran == [("step", 0), ("step", 0)]


def test_token_bound_is_set_for_the_duration_and_restored():
    groups = [ExpertParallel(None, 8), ExpertParallel(None, 8)]
    groups[1].token_bound = 5
    with token_bound(groups, 64):
        assert [g.token_bound for g in groups] == [64, 64]
    assert [g.token_bound for g in groups] == [None, 5]
    with pytest.raises(RuntimeError):
        with token_bound(groups, 32):
            raise RuntimeError("a failing step")
    assert [g.token_bound for g in groups] == [None, 5]


def test_every_forward_starts_on_parity_zero():
    class Transport:
        def __init__(self):
            self.starts = 0

        def start_forward(self):
            self.starts += 1

    ep = ExpertParallel(None, 8)
    ep.transports["x"] = Transport()
    ep.transports["plain"] = object()  # a transport without the hook is left alone
    ep.start_forward()
    assert ep.transports["x"].starts == 1
