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
    """What DataParallelStream drives: `steps` steps of work, each replayable or not."""

    def __init__(self, replayable: list[bool], ep_graph_bound: int | None, missing=()):
        self.plan = list(replayable)
        self.missing = set(missing)  # step numbers (0-based) whose graph this rank lacks
        self.step_no = 0
        self.ep_graph_bound = ep_graph_bound
        self.runtime = SimpleNamespace(device=torch.device("cpu"))
        self.num_prompt_tokens_computed = self.num_generated_tokens = 0
        self.ran: list[tuple[str, bool]] = []
        self.before = 0

    def has_unfinished(self):
        return bool(self.plan)

    def schedule(self):
        return SimpleNamespace(replayable=self.plan[0])

    def replayable(self, batch):
        return batch is None or batch.replayable

    def graph_to_capture(self, batch):
        return 8 if batch is not None and batch.replayable and self.step_no in self.missing else 0

    def capture_step(self, size):
        self.ran.append(("capture", size))

    def before_step(self):
        self.before += 1

    def execute(self, batch, graph_step):
        self.plan.pop(0)
        self.ran.append(("step", graph_step))
        self.step_no += 1
        return []

    def idle_step(self, graph_step):
        self.before += 1
        self.ran.append(("idle", graph_step))
        self.step_no += 1

    def abort_all(self):
        pass


def run_with_peer(monkeypatch, mine: list[bool], peer: list, bound: int | None, missing=()):
    """Run this rank's stream while a simulated peer contributes its flags: peer[i] is its step i
    (True replayable, "capture" replayable without its graph yet, False not, None idle); after its
    list it is idle. `missing`: this rank's steps whose graph it lacks."""
    steps = iter(peer)

    def all_reduce(flags, group=None):
        p = next(steps, None)
        flags += torch.tensor([int(p is not None), 0, int(p is False), int(p == "capture")])

    monkeypatch.setattr(data_parallel.dist, "all_reduce", all_reduce)
    engine = FakeEngine(mine, bound, missing)
    ctx = SimpleNamespace(rank=1, world_size=2, backend="gloo", group=None, timeout_s=5.0)
    list(data_parallel.DataParallelStream(engine, ctx, {}, 0, use_tqdm=False))
    return engine


def test_a_step_is_a_graph_step_only_when_every_rank_can_replay(monkeypatch):
    engine = run_with_peer(monkeypatch, [True, True, False, True], [True, False, True, None, True, False], bound=64)
    # step 1: both replay; 2: the peer prefills; 3: this rank prefills; 4: the peer is idle (joins);
    # 5: this rank is idle, the peer replays; 6: the peer prefills; then no rank has work: the end
    assert engine.ran == [("step", True), ("step", False), ("step", False), ("step", True), ("idle", True), ("idle", False)]
    assert engine.before == 6  # once per step on every rank, idle ones included


def test_a_graph_a_rank_lacks_is_captured_in_a_step_every_rank_joins(monkeypatch):
    # step 1: this rank lacks its graph (captures 8); 2: the peer lacks its (this rank joins with
    # idle forwards: capture 0); 3: the peer lacks one but this rank prefills: no capture, eager
    engine = run_with_peer(monkeypatch, [True, True, False], [True, "capture", "capture"], bound=64, missing={0})
    assert engine.ran == [("capture", 8), ("step", True), ("capture", 0), ("step", True), ("step", False)]


def test_without_graphs_every_step_is_eager(monkeypatch):
    engine = run_with_peer(monkeypatch, [True, True], [True, True], bound=None)
    assert engine.ran == [("step", False), ("step", False)]


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
