"""EPLB (deepinfer.distributed.eplb): balance quality on skewed loads, consistent maps, the
hierarchical-or-global rule, determinism, and the on-device load counter."""

from __future__ import annotations

import pytest
import torch

from deepinfer.distributed.eplb import (
    ExpertLoadCounter,
    balanced_packing,
    default_phy2log,
    gpu_loads,
    imbalance,
    log2phy_of,
    rebalance,
    replicate_experts,
    uses_hierarchical,
)


def skewed_load(layers: int, experts: int, seed: int, alpha: float = 1.2) -> torch.Tensor:
    """Zipf-like token counts (expert of rank i gets ~ 1 / i^alpha), shuffled per layer."""
    g = torch.Generator().manual_seed(seed)
    base = 1000.0 / (torch.arange(experts, dtype=torch.float64) + 1) ** alpha
    return torch.stack([base[torch.randperm(experts, generator=g)] for _ in range(layers)]).round()


# (logical experts, redundant, groups, nodes, GPUs, bound on max/mean GPU load after EPLB)
CASES = [
    pytest.param(16, 4, 4, 1, 4, 1.10, id="tiny-16+4-hier-1node-4gpu"),
    pytest.param(64, 16, 8, 2, 8, 1.15, id="64+16-hier-2nodes-8gpu"),
    pytest.param(60, 4, 3, 2, 8, 1.10, id="60+4-global-2nodes-8gpu"),
    pytest.param(256, 32, 8, 4, 32, 1.25, id="v3-256+32-hier-4nodes-32gpu"),
    pytest.param(256, 32, 8, 3, 24, 1.10, id="v3-256+32-global-3nodes-24gpu"),
]


@pytest.mark.parametrize("logical, redundant, groups, nodes, gpus, bound", CASES)
def test_balance_improves_on_skewed_load(logical, redundant, groups, nodes, gpus, bound):
    load = skewed_load(layers=3, experts=logical, seed=logical + gpus, alpha=0.8)
    physical = logical + redundant
    phy2log, log2phy, logcnt = rebalance(load, physical, groups, nodes, gpus)
    before = imbalance(load, default_phy2log(3, logical, physical), gpus)
    after = imbalance(load, phy2log, gpus)
    policy = "hierarchical" if uses_hierarchical(groups, nodes) else "global"
    report = f"max/mean load per GPU: before {before:.3f}, after {after:.3f} (bound {bound}; {policy})"
    print(report)
    assert after < before, report
    assert after <= bound, report
    # Every token is still served: the per-GPU loads add up to the total.
    assert torch.allclose(gpu_loads(load, phy2log, gpus).sum(-1), load.sum(-1)), report


def test_replicas_go_to_the_busiest_experts():
    load = torch.tensor([[100.0, 1, 1, 1, 50, 1, 1, 1]])
    phy2log, _, logcnt = rebalance(load, 12, 1, 1, 4)
    # 4 extra copies, each to the highest load per copy (ties: lowest index): 100 -> 100/2 ties
    # 50 and wins -> 50 (expert 4) -> 100/3 -> 100/4 = 25 = 50/2
    assert logcnt.tolist() == [[4, 1, 1, 1, 2, 1, 1, 1]]
    assert imbalance(load, phy2log, 4) < imbalance(load, default_phy2log(1, 8, 12), 4)


@pytest.mark.parametrize("groups, nodes, gpus, redundant", [(4, 1, 4, 4), (4, 2, 4, 0), (4, 2, 8, 8), (3, 2, 4, 4), (1, 1, 2, 2)])
def test_every_logical_expert_keeps_a_copy_and_the_maps_agree(groups, nodes, gpus, redundant):
    logical = 24 if groups == 3 else 16
    load = skewed_load(layers=4, experts=logical, seed=7)
    load[1] = 0  # a layer that saw no tokens
    load[2, :5] = 0  # experts that saw none
    physical = logical + redundant
    phy2log, log2phy, logcnt = rebalance(load, physical, groups, nodes, gpus)
    assert phy2log.shape == (4, physical) and logcnt.shape == (4, logical)
    assert log2phy.shape[:2] == (4, logical) and log2phy.shape[2] == int(logcnt.max()) <= redundant + 1
    assert (logcnt >= 1).all(), "a logical expert lost its last copy"
    assert (logcnt.sum(-1) == physical).all()
    for layer in range(4):
        assert sorted(set(phy2log[layer].tolist())) == list(range(logical))
        seen = []
        for e in range(logical):
            copies = log2phy[layer, e, : logcnt[layer, e]].tolist()
            assert all(phy2log[layer, p] == e for p in copies), (layer, e, copies)
            assert copies == sorted(copies)
            assert (log2phy[layer, e, logcnt[layer, e] :] == -1).all()
            assert int((phy2log[layer] == e).sum()) == logcnt[layer, e]
            seen += copies
        assert sorted(seen) == list(range(physical)), "each physical expert is exactly one copy"
    again, again_cnt = log2phy_of(phy2log, logical)
    assert torch.equal(again, log2phy) and torch.equal(again_cnt, logcnt)


def test_hierarchical_when_groups_divide_over_nodes_global_otherwise():
    logical, gpus, nodes = 16, 4, 2
    load = skewed_load(layers=2, experts=logical, seed=3)
    # 4 groups over 2 nodes: hierarchical. Each node (GPUs 0-1, 2-3) holds whole groups, and all
    # copies of an expert stay within its group's node.
    assert uses_hierarchical(4, 2)
    phy2log, _, _ = rebalance(load, 24, 4, nodes, gpus)
    per_node = phy2log.view(2, nodes, -1)
    for layer in range(2):
        groups_on_node = [set((per_node[layer, n] // 4).tolist()) for n in range(nodes)]
        assert all(len(g) == 2 for g in groups_on_node), groups_on_node
        assert not (groups_on_node[0] & groups_on_node[1]), groups_on_node
    # 3 groups over 2 nodes: global, which is the same as one group on one node.
    assert not uses_hierarchical(3, 2)
    load24 = skewed_load(layers=2, experts=24, seed=3)
    global_maps = rebalance(load24, 32, 3, 2, gpus)
    flat_maps = rebalance(load24, 32, 1, 1, gpus)
    for a, b in zip(global_maps, flat_maps):
        assert torch.equal(a, b)


def test_deterministic_and_input_dtype_independent():
    load = skewed_load(layers=3, experts=64, seed=11)
    first = rebalance(load, 80, 8, 2, 8)
    for other in (load.clone(), load.to(torch.int64), load.float(), load.to(torch.int32)):
        for a, b in zip(first, rebalance(other, 80, 8, 2, 8)):
            assert torch.equal(a, b)
    ties = torch.ones(2, 16)  # all equal: the lowest index wins every tie, run after run
    assert torch.equal(rebalance(ties, 20, 4, 1, 4)[0], rebalance(ties.clone(), 20, 4, 1, 4)[0])


def test_one_dimensional_load():
    load = skewed_load(layers=1, experts=16, seed=5)[0]
    phy2log, log2phy, logcnt = rebalance(load, 20, 4, 1, 4)
    assert phy2log.shape == (20,) and logcnt.shape == (16,) and log2phy.shape[0] == 16
    batched = rebalance(load.unsqueeze(0), 20, 4, 1, 4)
    assert torch.equal(phy2log, batched[0][0])


@pytest.mark.parametrize(
    "physical, groups, nodes, gpus, message",
    [(18, 4, 1, 4, "divide over num_gpus"), (12, 4, 1, 4, "fewer than"), (16, 4, 3, 4, "num_nodes"), (16, 5, 1, 4, "num_groups")],
)
def test_sizes_that_do_not_fit_are_refused(physical, groups, nodes, gpus, message):
    with pytest.raises(ValueError, match=message):
        rebalance(torch.ones(16), physical, groups, nodes, gpus)


def test_balanced_packing_fills_packs_evenly():
    weight = torch.tensor([[9.0, 8, 7, 6, 5, 4, 3, 2]])
    pack, rank = balanced_packing(weight, 4)
    assert sorted(pack[0].tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]
    for p in range(4):  # ranks within a pack are 0..capacity-1
        assert sorted(rank[0][pack[0] == p].tolist()) == [0, 1]
    loads = torch.zeros(4).index_add_(0, pack[0], weight[0])
    assert loads.tolist() == [11.0, 11.0, 11.0, 11.0]


def test_replicate_experts_counts():
    phy2log, replica, count = replicate_experts(torch.tensor([[6.0, 3.0, 1.0]]), 6)
    assert count.tolist() == [[3, 2, 1]]  # 6 -> 6/2 = 3 ties 3 (lowest index wins) -> 3
    for p in range(6):
        e = phy2log[0, p]
        assert replica[0, p] < count[0, e]


def test_load_counter_counts_on_the_device_and_resets():
    counter = ExpertLoadCounter(2, 8)
    ids = torch.tensor([[0, 3], [3, 7], [0, 3]], dtype=torch.int32)
    ExpertLoadCounter.record(counter.row(1), ids)
    ExpertLoadCounter.record(counter.row(1), ids[:1])
    taken = counter.take()
    assert taken[0].tolist() == [0] * 8
    assert taken[1].tolist() == [3, 0, 0, 4, 0, 0, 0, 1]
    assert counter.counts.sum() == 0
