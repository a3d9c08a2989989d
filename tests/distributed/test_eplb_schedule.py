"""EPLB during a run (distributed.eplb_schedule) with a fake model: counting starts with the
schedule, a rebalance is due after every `interval` steps, it places the experts by EPLB from the
counts since the last one (summed over the ranks), and a failed sum is a one-line PeerFailure."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer.distributed.eplb import default_phy2log, rebalance
from deepinfer.distributed.eplb_schedule import EplbSchedule, rebalance_experts
from deepinfer.distributed.group import PeerFailure
from deepinfer.model.moe import ExpertPlacement

LAYERS, EXPERTS, PHYSICAL, RANKS = 2, 4, 6, 2


class FakeModel:
    """What EPLB needs of a model: its config, its placement, where it counts, how it re-places."""

    def __init__(self):
        self.config = SimpleNamespace(num_hidden_layers=LAYERS, is_moe_layer=lambda i: True, n_routed_experts=EXPERTS, routing_groups=(1, 1))
        self.placement = ExpertPlacement(default_phy2log(LAYERS, EXPERTS, PHYSICAL), rank=0, size=RANKS)
        self.counts = None
        self.applied: list[torch.Tensor] = []

    def count_expert_load(self, counts):
        self.counts = counts

    def set_expert_placement(self, phy2log):
        local = self.placement.local_slots
        read = int((phy2log[:, local.start : local.stop] != self.placement.phy2log[:, local.start : local.stop]).sum())
        self.placement.phy2log = phy2log.clone()
        self.applied.append(phy2log.clone())
        return read


def skewed() -> torch.Tensor:
    return torch.tensor([[90, 5, 3, 2], [1, 1, 50, 8]], dtype=torch.int64)


def test_counting_starts_with_the_schedule_and_rebalances_after_every_interval_steps():
    model = FakeModel()
    eplb = EplbSchedule(model, torch.device("cpu"), interval=3)
    assert model.counts is eplb.counter.counts  # the MoE layers count into the schedule's tensor
    model.counts += skewed()
    moved = [steps_run for steps_run in range(7) if eplb.before_step(steps_run)]
    assert moved == [3]  # not before the first step; at 6 the counts were taken at 3 and nothing new came
    want = rebalance(skewed(), PHYSICAL, 1, 1, RANKS)[0]
    assert len(model.applied) == 1 and torch.equal(model.applied[0], want)
    assert eplb.num_rebalances == 1 and eplb.num_experts_read > 0
    assert int(model.counts.sum()) == 0  # counting starts again from zero


def test_nothing_moves_without_load_or_when_the_placement_is_already_eplbs():
    model = FakeModel()
    assert rebalance_experts(model, torch.zeros(LAYERS, EXPERTS, dtype=torch.int64)) is None
    done = rebalance_experts(model, skewed())
    assert done is not None and done.imbalance_after < done.imbalance_before
    assert rebalance_experts(model, skewed()) is None  # the same load: the same placement
    assert len(model.applied) == 1


def test_without_an_interval_it_only_counts():
    model = FakeModel()
    eplb = EplbSchedule(model, torch.device("cpu"))
    model.counts += skewed()
    assert not any(eplb.before_step(n) for n in range(1, 50)) and not model.applied
    assert eplb.rebalance(50) and len(model.applied) == 1


def test_the_load_is_summed_over_the_ranks_first(monkeypatch):
    peer = torch.tensor([[0, 0, 0, 400], [300, 0, 0, 0]], dtype=torch.int64)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: tensor.add_(peer))
    ctx = SimpleNamespace(rank=0, world_size=2, backend="gloo", group=None, timeout_s=5.0)
    model = FakeModel()
    rebalance_experts(model, skewed(), ctx)
    assert torch.equal(model.applied[0], rebalance(skewed() + peer, PHYSICAL, 1, 1, RANKS)[0])


def test_a_failed_sum_is_a_one_line_peer_failure(monkeypatch):
    def all_reduce(tensor, group=None):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    ctx = SimpleNamespace(rank=1, world_size=2, backend="gloo", group=None, timeout_s=7.0)
    with pytest.raises(PeerFailure, match=r"rank 1 of 2: the all_reduce of expert loads \(EPLB\) failed .* 7 s"):
        rebalance_experts(FakeModel(), skewed(), ctx)


def test_a_model_without_a_placement_is_refused():
    model = FakeModel()
    model.placement = None
    with pytest.raises(ValueError, match="expert placement"):
        EplbSchedule(model, torch.device("cpu"), interval=2)
