"""The ranks' per-step agreement and lockstep steps, without a GPU or a second process: what the
summed flags decide (distributed.step_agreement), what one rank then runs and under which token
bound (distributed.lockstep, driven by DataParallelStream against a simulated peer), and what keeps
a captured forward's buffers in step with the other ranks (every forward starts on parity 0)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer.distributed import step_agreement
from deepinfer.distributed.expert_parallel import ExpertParallel, token_bound
from deepinfer.distributed.group import PeerFailure
from deepinfer.distributed.step_agreement import RankStep, StepAgreement, decide, encode
from deepinfer.engine.data_parallel import DataParallelStream

SIZES = [1, 2, 4, 8, 16]


def rank(has_work=True, finished=0, replayable=True, bucket=None, prompt=0, generated=0, unfinished=False) -> RankStep:
    return RankStep(has_work, finished, replayable, bucket, prompt, generated, unfinished)


def agreed(*ranks: RankStep, sizes=SIZES):
    return decide(sum(encode(r, len(sizes)) for r in ranks).tolist(), sizes)


# ---- the decision -------------------------------------------------------------------------------


def test_every_rank_replays_the_largest_graph_among_them():
    step = agreed(rank(bucket=1), rank(bucket=3), rank(has_work=False))  # an idle rank joins with padding
    assert step.graph_size == 8 and step.ranks_with_work == 2


def test_one_eager_rank_makes_the_step_eager_everywhere():
    assert agreed(rank(bucket=4), rank(replayable=False)).graph_size == 0  # a prefill on one rank
    assert agreed(rank(bucket=2), rank(bucket=0), sizes=SIZES).graph_size == 4
    assert agreed(rank(), rank(), sizes=[]).graph_size == 0  # no graphs at all


def test_the_run_ends_when_no_rank_has_work_and_counts_are_totals():
    step = agreed(rank(has_work=False, finished=2, prompt=10, generated=3), rank(has_work=False, finished=1, prompt=5, generated=4))
    assert (step.ranks_with_work, step.num_finished, step.prompt_tokens, step.generated_tokens) == (0, 3, 15, 7)
    assert step.ranks_unfinished == 0


def test_requests_loading_from_a_kv_tier_keep_the_run_going():
    step = agreed(rank(has_work=False, unfinished=True), rank(has_work=False))  # rank 0's requests all load their prefix
    assert step.ranks_with_work == 0 and step.ranks_unfinished == 1  # no forward, but the run is not over
    assert agreed(rank(), rank(has_work=False)).ranks_unfinished == 1  # a rank with work has unfinished requests


# ---- the collectives ----------------------------------------------------------------------------

CTX0 = SimpleNamespace(rank=0, world_size=2, backend="gloo", group=None, timeout_s=5.0)
CTX1 = SimpleNamespace(rank=1, world_size=2, backend="gloo", group=None, timeout_s=5.0)


def test_agree_sums_the_peers_flags(monkeypatch):
    peer = encode(rank(bucket=4, generated=5), len(SIZES))
    monkeypatch.setattr(step_agreement.dist, "all_reduce", lambda flags, group=None: flags.add_(peer))
    step = StepAgreement(CTX1, SIZES, torch.device("cpu")).agree(rank(bucket=0, generated=2))
    assert (step.graph_size, step.generated_tokens, step.ranks_with_work) == (16, 7, 2)


def test_finished_results_are_gathered_to_rank0_in_input_order(monkeypatch):
    def gather_object(obj, gathered, dst=0, group=None):
        if gathered is not None:
            gathered[0], gathered[1] = obj, [(1, "b"), (4, "e")]

    monkeypatch.setattr(step_agreement.dist, "gather_object", gather_object)
    assert StepAgreement(CTX0, SIZES, torch.device("cpu")).gather_finished([(3, "d"), (0, "a")]) == [(0, "a"), (1, "b"), (3, "d"), (4, "e")]
    assert StepAgreement(CTX1, SIZES, torch.device("cpu")).gather_finished([(2, "c")]) == []


def test_a_failed_agreement_is_a_one_line_peer_failure(monkeypatch):
    def all_reduce(flags, group=None):
        raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1234: Connection reset by peer.\nmore lines")

    monkeypatch.setattr(step_agreement.dist, "all_reduce", all_reduce)
    with pytest.raises(PeerFailure) as caught:
        StepAgreement(CTX1, SIZES, torch.device("cpu")).agree(rank())
    message = str(caught.value)
    assert "rank 1 of 2: the per-step all_reduce of work flags failed" in message and "--dist-timeout" in message and "\n" not in message


# ---- one rank's lockstep steps, against a simulated peer ------------------------------------------


class FakeGraphs:
    def __init__(self, sizes, log, groups):
        self.buckets, self.log, self.groups = sizes, log, groups
        self.captured: set[int] = set()
        self.collective = False

    def bound(self):
        return self.groups[0].token_bound

    def bucket(self, n):
        return next((b for b in self.buckets if b >= n), None)

    def capture(self, size):
        if size not in self.captured:
            self.captured.add(size)
            self.log.append(("capture", size, self.bound()))

    def run_padding(self, size):
        self.log.append(("idle", size, self.bound()))


class FakeEngine:
    """What the lockstep drives: a plan of batches ("prefill", or the number of decoding sequences),
    each finishing the sequences listed with it; a log of what ran and the token bound it ran under."""

    def __init__(self, plan: list, sizes: list[int] | None):
        self.plan = list(plan)
        self.log: list[tuple] = []
        groups = [ExpertParallel(None, 8)]
        self.loaded = SimpleNamespace(model=SimpleNamespace(expert_parallels=groups))
        graphs = FakeGraphs(sizes, self.log, groups) if sizes else None
        self.runner = SimpleNamespace(graphs=graphs, replayable=self._replayable, run_idle=lambda: self.log.append(("idle", 0, groups[0].token_bound)))
        self.runtime = SimpleNamespace(device=torch.device("cpu"))
        self.num_prompt_tokens_computed = self.num_generated_tokens = 0
        self.num_steps = 0

    def _replayable(self, batch):
        graphs = self.runner.graphs
        return graphs is not None and batch.kind != "prefill" and graphs.bucket(batch.kind) is not None

    def has_unfinished(self):
        return bool(self.plan)

    def flush_tiers(self):  # no KV tiers here
        pass

    def schedule(self):
        kind, done = self.plan[0] if isinstance(self.plan[0], tuple) else (self.plan[0], [])
        return SimpleNamespace(kind=kind, seqs=[None] * (kind if kind != "prefill" else 1), done=done)

    def before_step(self):
        self.num_steps += 1

    def execute(self, batch, graph_size):
        self.plan.pop(0)
        self.num_generated_tokens += 1
        self.log.append(("step", graph_size, self.loaded.model.expert_parallels[0].token_bound))
        return [SimpleNamespace(seq_id=i) for i in batch.done]

    def make_output(self, seq):
        return f"output {seq.seq_id}"

    def abort_all(self):  # the stream's clean-up: this fake holds no requests to drop
        pass


def peer_flags(step, sizes):
    """A simulated peer's flags: a batch size (decoding), "prefill", or None (idle)."""
    if step is None:
        return encode(rank(has_work=False), len(sizes))
    if step == "prefill":
        return encode(rank(replayable=False), len(sizes))
    return encode(rank(bucket=sizes.index(next(b for b in sizes if b >= step)) if sizes else None, replayable=bool(sizes)), len(sizes))


def run_with_peer(monkeypatch, mine: list, peer: list, sizes=SIZES, ctx=CTX1):
    """Iterate this rank's stream while a simulated peer adds its flags to every agreement; after
    its list the peer is idle. Returns the engine and what the stream yielded."""
    steps = iter(peer)
    monkeypatch.setattr(step_agreement.dist, "all_reduce", lambda flags, group=None: flags.add_(peer_flags(next(steps, None), sizes or [])))

    def gather_object(obj, gathered, dst=0, group=None):
        if gathered is not None:
            gathered[0], gathered[1] = obj, []

    monkeypatch.setattr(step_agreement.dist, "gather_object", gather_object)
    engine = FakeEngine(mine, sizes)
    results = list(DataParallelStream(engine, ctx, {i: 10 + i for i in range(10)}, 0, use_tqdm=False))
    return engine, results


def test_each_step_runs_the_agreed_graph_under_its_token_bound(monkeypatch):
    engine, _ = run_with_peer(monkeypatch, [2, 8, "prefill", 3, 1], [8, 2, 2, None, "prefill", 16])
    assert engine.log == [
        ("capture", 8, 8), ("step", 8, 8),  # this rank's 2 sequences ride the peer's graph of 8 (captured together, first time)
        ("step", 8, 8),  # the peer's 2 in this rank's graph of 8 (already captured)
        ("step", 0, None),  # this rank prefills: eager on both, no token bound (the dispatches exchange counts)
        ("capture", 4, 4), ("step", 4, 4),  # the peer idle: it replays the graph of 4 with padding only
        ("step", 0, None),  # the peer prefills
        ("capture", 16, 16), ("idle", 16, 16),  # this rank idle, replaying the peer's graph of 16 with padding
    ]
    assert engine.num_steps == 6  # once per step on every rank, idle ones included
    assert engine.runner.graphs.collective, "a rank must never capture a graph on its own"
    assert engine.loaded.model.expert_parallels[0].token_bound is None  # restored after each step


def test_without_graphs_every_step_is_eager_and_an_idle_rank_runs_an_empty_forward(monkeypatch):
    engine, _ = run_with_peer(monkeypatch, [1, 1], [1, 1, 1], sizes=None)
    assert engine.log == [("step", 0, None), ("step", 0, None), ("idle", 0, None)]


def test_rank0_yields_what_finished_in_the_step_after(monkeypatch):
    engine, results = run_with_peer(monkeypatch, [(1, [0]), (1, []), (1, [2])], [1], ctx=CTX0)
    assert results == [(10, "output 0"), (12, "output 2")]
    _, nothing = run_with_peer(monkeypatch, [(1, [0])], [], ctx=CTX1)
    assert nothing == []  # only rank 0 yields


def test_a_model_step_that_fails_on_the_collective_is_a_peer_failure(monkeypatch):
    def execute(batch, graph_size):
        raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")

    monkeypatch.setattr(step_agreement.dist, "all_reduce", lambda flags, group=None: flags)
    engine = FakeEngine([1], None)
    engine.execute = execute
    with pytest.raises(PeerFailure, match="rank 1 of 2: a model step failed"):
        list(DataParallelStream(engine, CTX1, {}, 0, use_tqdm=False))


# ---- token bound and buffer parity --------------------------------------------------------------


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
