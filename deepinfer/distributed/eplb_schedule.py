"""EPLB during a run: count the tokens routed to each expert, and re-place the experts between steps.

`EplbSchedule` starts the model's load counting (each MoE layer adds its logical top-k ids into its
row of one `[MoE layers, experts]` tensor on the device, `ExpertLoadCounter`) and, every `interval`
steps, calls `rebalance_experts`: the counts since the last time, summed over the ranks of the
expert-parallel group (one all_reduce), give a new placement by EPLB (`eplb.rebalance`), which the
model applies (`set_expert_placement`: experts a rank gains are read from the checkpoint).

Both are collectives: every rank of the group calls them at the same step, before that step's
forward. Steps are counted by the caller, idle ones included, so every rank agrees when one is due.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deepinfer.distributed.eplb import ExpertLoadCounter, imbalance, rebalance
from deepinfer.distributed.group import DistContext, collective_failure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replacement:
    """A new expert placement applied: the load it was computed from, balanced before and after
    (max / mean load per rank, averaged over the MoE layers), and what this rank read for it."""

    imbalance_before: float
    imbalance_after: float
    experts_read: int


def rebalance_experts(model, load: torch.Tensor, dist: DistContext | None = None) -> Replacement | None:
    """Re-place the model's experts by EPLB for `load` ([MoE layers, logical experts] tokens counted on
    this rank; summed over the ranks of `dist` first). A collective with `dist`: every rank calls it
    at the same step, with its own counts. None when nothing moved: no load was counted, or EPLB's
    placement for it is the current one."""
    if dist is not None:
        import torch.distributed as torch_dist

        wire = load.cpu() if dist.backend == "gloo" else load
        try:
            torch_dist.all_reduce(wire, group=dist.group)
        except Exception as exc:
            raise collective_failure(dist, "the all_reduce of expert loads (EPLB)", exc) from exc
        load = wire
    load = load.cpu()
    if not int(load.sum()):
        return None
    placement = model.placement
    groups = model.config.routing_groups[0]
    phy2log = rebalance(load, placement.num_physical, groups, placement.num_nodes, placement.size)[0]
    if torch.equal(phy2log, placement.phy2log):
        return None
    before = imbalance(load, placement.phy2log, placement.size)
    read = model.set_expert_placement(phy2log)
    return Replacement(before, imbalance(load, phy2log, placement.size), read)


class EplbSchedule:
    """Counts the expert load of `model` on `device` from now on and re-places the experts every
    `interval` steps (None: only when `rebalance` is called). The model must have been loaded with
    an expert placement (expert parallelism or redundant experts)."""

    def __init__(self, model, device: torch.device, dist: DistContext | None = None, interval: int | None = None):
        from deepinfer.model.deepseek import moe_layer_indices

        if getattr(model, "placement", None) is None:
            raise ValueError("EPLB needs a model loaded with an expert placement (expert parallelism or redundant experts)")
        self.model = model
        self.dist = dist
        self.interval = interval
        self.counter = ExpertLoadCounter(len(moe_layer_indices(model.config)), model.config.n_routed_experts, device)
        model.count_expert_load(self.counter.counts)
        self.num_rebalances = 0  # placements applied
        self.num_experts_read = 0  # experts this rank read from the checkpoint for them

    def before_step(self, steps_run: int) -> bool:
        """Rebalance if one is due before the next step: after every `interval` steps (steps_run:
        the steps run so far, idle ones included: the same on every rank). Returns whether
        anything moved."""
        if self.interval is not None and steps_run and steps_run % self.interval == 0:
            return self.rebalance(steps_run)
        return False

    def rebalance(self, steps_run: int) -> bool:
        """Re-place the experts from the load counted since the last time (every rank, the same
        step; steps_run names it in the log). Returns whether anything moved."""
        done = rebalance_experts(self.model, self.counter.take(), self.dist)
        if done is None:
            return False
        self.num_rebalances += 1
        self.num_experts_read += done.experts_read
        log.info(
            "EPLB at step %d: max/mean expert load per rank %.3f -> %.3f; %d experts read from the checkpoint on this rank",
            steps_run, done.imbalance_before, done.imbalance_after, done.experts_read,
        )
        return True
