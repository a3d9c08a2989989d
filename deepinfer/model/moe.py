"""DeepSeek's mixture of experts: router -> gate -> dispatch -> experts -> combine, plus shared experts.

Expert parallelism (EP) and redundant experts. Each MoE layer has P physical experts (the logical
experts of the checkpoint plus redundant copies), described by `phy2log` (the logical expert each
physical expert holds). Over an EP group of S ranks, rank r holds physical experts
[r * L, (r + 1) * L) with L = P / S, and only their weights: copies of one logical expert are
loaded once and copied. A step runs:

  gate (logical top-k ids) -> physical ids: token t's k-th choice e goes to copy
  (t * K + k) mod logcnt[e] of e (deterministic; copies hold identical weights, so the choice
  never changes a result) -> ops.dispatch(..., num_experts=P, ep_group) (rows travel to the ranks
  that hold their experts) -> grouped GEMMs over this rank's L experts -> ops.combine(..., ep_group,
  add=shared experts' output) (rows travel back, weighted sum, plus the shared experts' rows, which
  every rank computes for its own tokens: it holds them).

Every rank calls every MoE layer every step, with an empty batch when it has no tokens, because
dispatch and combine are collectives. `set_placement` changes phy2log between steps: each rank
copies the experts it keeps from its own memory and reads the ones it gains from the checkpoint
(an `ExpertSource`), so no host copy of the logical weights is kept (see docs/distributed.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer.model.config import ModelConfig
from deepinfer.model.linear import ExpertWeights, FusedExperts, LinearWeight
from deepinfer.model.mlp import DenseMLP, mlp_specs
from deepinfer.model.weights import FLOAT32, LINEAR, TensorSpec, WeightStore

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def moe_specs(config: ModelConfig, prefix: str) -> dict[str, TensorSpec]:
    c = config
    hidden, inter = c.hidden_size, c.moe_intermediate_size
    specs = {f"{prefix}gate.weight": TensorSpec((c.n_routed_experts, hidden), FLOAT32)}
    if c.uses_correction_bias:
        specs[f"{prefix}gate.e_score_correction_bias"] = TensorSpec((c.n_routed_experts,), FLOAT32)
    for e in range(c.n_routed_experts):
        specs[f"{prefix}experts.{e}.gate_proj.weight"] = TensorSpec((inter, hidden), LINEAR)
        specs[f"{prefix}experts.{e}.up_proj.weight"] = TensorSpec((inter, hidden), LINEAR)
        specs[f"{prefix}experts.{e}.down_proj.weight"] = TensorSpec((hidden, inter), LINEAR)
    if c.n_shared_experts:
        specs.update(mlp_specs(hidden, inter * c.n_shared_experts, f"{prefix}shared_experts."))
    return specs


def expert_tensor_prefix(layer_prefix: str, expert: int, projection: str) -> str:
    """`model.layers.3.mlp.` + 5 + up_proj -> `model.layers.3.mlp.experts.5.up_proj` (add `.weight`)."""
    return f"{layer_prefix}experts.{expert}.{projection}"


class ExpertSource(Protocol):
    """Reads one logical expert's weights (gate, up, down) of the MoE layer at `layer_prefix`
    (e.g. `model.layers.3.mlp.`), in their kept format, on the model's device."""

    def __call__(self, layer_prefix: str, expert: int) -> tuple[LinearWeight, LinearWeight, LinearWeight]: ...


@dataclass
class ExpertPlacement:
    """Where the physical experts of every MoE layer live, and which of them this rank holds.

    phy2log: [num_moe_layers, P] int64 (CPU), MoE layers counted in model order. rank / size: this
    rank in the EP group; ep_group: the object passed to dispatch / combine (None for one rank).
    """

    phy2log: torch.Tensor
    rank: int = 0
    size: int = 1
    ep_group: object | None = None
    num_nodes: int = 1  # hosts the group spans (for EPLB's hierarchical policy)

    def __post_init__(self):
        self.phy2log = self.phy2log.detach().to("cpu", torch.int64)
        if self.phy2log.dim() != 2:
            raise ValueError(f"phy2log must be [num_moe_layers, num_physical], got {tuple(self.phy2log.shape)}")
        if self.num_physical % self.size:
            raise ValueError(f"{self.num_physical} physical experts do not divide over {self.size} ranks")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside the group of {self.size}")

    @property
    def num_physical(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def experts_per_rank(self) -> int:
        return self.num_physical // self.size

    @property
    def local_slots(self) -> range:
        per = self.experts_per_rank
        return range(self.rank * per, (self.rank + 1) * per)

    def local_logical(self, moe_index: int) -> list[int]:
        """The logical expert held by each of this rank's physical experts of one MoE layer."""
        slots = self.local_slots
        return self.phy2log[moe_index, slots.start : slots.stop].tolist()


@dataclass
class ExpertSharding:
    """How to lay the experts out before loading (the model's config gives the sizes).

    ctx: the run's process group (deepinfer.distributed.DistContext; None: one process): the
    experts are sharded over all its ranks. num_redundant_experts: extra physical experts per MoE
    layer (copies of busy experts). num_nodes: hosts the run spans (EPLB's hierarchical policy keeps
    an expert group within a node). initial_load: tokens per logical expert ([num_moe_layers, E],
    or [E] for every layer) to place the experts by EPLB from the start; None: physical expert p
    holds logical expert p mod E.
    """

    ctx: object | None = None
    num_redundant_experts: int = 0
    num_nodes: int = 1
    initial_load: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return self.ctx.rank if self.ctx is not None else 0

    @property
    def size(self) -> int:
        return self.ctx.world_size if self.ctx is not None else 1

    def placement(self, config: ModelConfig) -> ExpertPlacement:
        from deepinfer.distributed.eplb import default_phy2log, rebalance

        num_moe = sum(1 for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
        logical = config.n_routed_experts
        physical = logical + self.num_redundant_experts
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if physical % self.size:
            raise ValueError(
                f"{logical} routed experts + {self.num_redundant_experts} redundant = {physical} physical experts per layer "
                f"do not divide over {self.size} expert-parallel ranks; choose num_redundant_experts so that they do"
            )
        if self.initial_load is None:
            phy2log = default_phy2log(num_moe, logical, physical)
        else:
            load = torch.as_tensor(self.initial_load).detach().to("cpu", torch.float64)
            if load.dim() == 1:
                load = load.expand(num_moe, -1)
            if tuple(load.shape) != (num_moe, logical):
                raise ValueError(f"the expert load must be [{num_moe} MoE layers, {logical} experts] (or [{logical}]), got {tuple(load.shape)}")
            phy2log = rebalance(load, physical, config.routing_groups[0], self.num_nodes, self.size)[0]
        ep_group = None
        if self.size > 1:
            from deepinfer.distributed.expert_parallel import ExpertParallel

            ep_group = ExpertParallel.from_context(self.ctx, physical)
        return ExpertPlacement(phy2log, self.rank, self.size, ep_group, self.num_nodes)


class MoE:
    """One MoE layer. `placement=None`: every logical expert once, all local (no EP)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: WeightStore,
        prefix: str,
        *,
        placement: ExpertPlacement | None = None,
        moe_index: int = 0,
    ):
        c = self.config = config
        self.prefix = prefix
        self.moe_index = moe_index
        self.num_experts = c.n_routed_experts  # logical
        self.top_k = c.num_experts_per_tok
        self.router = weights.tensor(f"{prefix}gate.weight")  # [E, H] float32
        self.correction_bias = weights.tensor(f"{prefix}gate.e_score_correction_bias") if c.uses_correction_bias else None
        self.device = self.router.device
        self.shared = DenseMLP(weights, f"{prefix}shared_experts.") if c.n_shared_experts else None
        self.n_group, self.topk_group = c.routing_groups
        self.load: torch.Tensor | None = None  # [E] int64 row of an ExpertLoadCounter when counting
        # Without a placement the physical experts are the logical ones (no remapping); with one,
        # ids are always remapped (a later placement may differ; the branch never changes).
        self.identity = placement is None
        if placement is None:
            placement = ExpertPlacement(torch.arange(self.num_experts).unsqueeze(0))
            moe_index = 0
        self.ep_group = placement.ep_group if placement.size > 1 else None
        self.num_physical = placement.num_physical
        self.rank, self.size = placement.rank, placement.size
        # Routing tables, fixed shape so that a new placement is copied in place (CUDA graphs keep
        # pointing at them): a logical expert has at most P - E + 1 copies.
        max_copies = self.num_physical - self.num_experts + 1
        self.log2phy = torch.full((self.num_experts, max_copies), -1, dtype=torch.int32, device=self.device)
        self.logcnt = torch.ones(self.num_experts, dtype=torch.int32, device=self.device)
        local = placement.local_logical(moe_index)
        loaded: dict[int, tuple[LinearWeight, ...]] = {}
        for e in local:
            if e not in loaded:  # a copy reuses the tensors read for the first one
                loaded[e] = tuple(weights.linear(expert_tensor_prefix(prefix, e, p)) for p in EXPERT_PROJECTIONS)
        self.gate_up, self.down = stack_experts([loaded[e] for e in local])
        self.local_logical = local
        self._set_routing(placement.phy2log[moe_index])

    # ---- placement -----------------------------------------------------------------------------

    def _set_routing(self, phy2log: torch.Tensor) -> None:
        from deepinfer.distributed.eplb import log2phy_of

        log2phy, logcnt = log2phy_of(phy2log, self.num_experts)
        table = torch.full(tuple(self.log2phy.shape), -1, dtype=torch.int32)
        table[:, : log2phy.shape[1]] = log2phy.to(torch.int32)
        self.log2phy.copy_(table)
        self.logcnt.copy_(logcnt.to(torch.int32))

    def set_placement(self, phy2log: torch.Tensor, source: ExpertSource | None) -> int:
        """Hold the experts phy2log [P] gives this rank from now on; returns how many were read
        from `source` (experts this rank did not hold before). Weights are updated in place."""
        phy2log = phy2log.detach().to("cpu", torch.int64)
        if phy2log.shape != (self.num_physical,):
            raise ValueError(f"MoE layer {self.prefix}: phy2log must have {self.num_physical} entries, got {tuple(phy2log.shape)}")
        per = self.num_physical // self.size
        new_local = phy2log[self.rank * per : (self.rank + 1) * per].tolist()
        held = {}
        for slot, e in enumerate(self.local_logical):
            held.setdefault(e, slot)
        missing = sorted({e for e in new_local if e not in held})
        if missing and source is None:
            raise RuntimeError(f"MoE layer {self.prefix}: experts {missing} are not on this rank and the model has no expert source to read them from")
        fresh = {e: [*stack_experts([source(self.prefix, e)])] for e in missing}  # [1, ...] each
        targets = [*self.gate_up.parts, self.down]
        # The new weights are built beside the old ones (one layer's local experts, transiently),
        # then copied over them: captured CUDA graphs keep pointing at the same tensors.
        staged = [_clone(part) for part in targets]
        for slot, e in enumerate(new_local):
            for j, part in enumerate(staged):
                if e in held:
                    src, i = targets[j], held[e]
                else:
                    src, i = _flat_parts(fresh[e])[j], 0
                part.weight[slot].copy_(src.weight[i])
                if part.scale is not None:
                    part.scale[slot].copy_(src.scale[i])
        for part, target in zip(staged, targets):
            target.weight.copy_(part.weight)
            if target.scale is not None:
                target.scale.copy_(part.scale)
        self.local_logical = new_local
        self._set_routing(phy2log)
        self.identity = False
        return len(missing)

    # ---- running -------------------------------------------------------------------------------

    def physical_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Logical top-k ids [T, K] -> physical ids: copy (t * K + k) mod logcnt[e] of expert e."""
        if self.identity:
            return topk_ids
        ids = topk_ids.long()
        slot = torch.arange(ids.numel(), device=ids.device).view(ids.shape)
        copy = slot % self.logcnt[ids].long()
        return self.log2phy[ids, copy]

    def __call__(self, ops, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        tokens = x.shape[0]
        if tokens:
            logits = ops.linear(x, self.router, fmt="dense", out_dtype=torch.float32)  # the router runs in float32, on x as it is
            topk_weights, topk_ids = ops.gate(
                logits,
                top_k=c.num_experts_per_tok,
                score_func=c.scoring_func,
                correction_bias=self.correction_bias,
                n_group=self.n_group,
                topk_group=self.topk_group,
                renormalize=c.norm_topk_prob,
                routed_scaling_factor=c.routed_scaling_factor,
            )
            if self.load is not None:
                ids = topk_ids.reshape(-1).long()
                self.load.index_add_(0, ids, torch.ones_like(ids))  # on the device: no host sync
        else:  # a rank with no work still joins the EP collectives
            topk_weights = torch.empty(0, self.top_k, dtype=torch.float32, device=x.device)
            topk_ids = torch.empty(0, self.top_k, dtype=torch.int32, device=x.device)
        ep = {"ep_group": self.ep_group} if self.ep_group is not None else {}
        expert_x, expert_offsets, row_of_slot = ops.dispatch(x, self.physical_ids(topk_ids), num_experts=self.num_physical, **ep)
        if expert_x.shape[0]:  # rows received: known on the host (dispatch sized the buffer)
            hidden = ops.silu_and_mul(self.gate_up(ops, expert_x, expert_offsets))
            expert_out = self.down(ops, hidden, expert_offsets)
        else:
            expert_out = expert_x.new_empty(0, c.hidden_size)
        # the shared experts' output joins combine's float32 sum (one rounding, no launch of its own)
        shared = self.shared(ops, x) if self.shared is not None and tokens else None
        return ops.combine(expert_out, topk_weights, row_of_slot, add=shared, **ep)


def stack_experts(experts: list[tuple[LinearWeight, ...]]) -> tuple[FusedExperts, ExpertWeights]:
    """(gate, up, down) per local expert -> (gate_up [L, 2I, H] fused when the formats allow, down [L, H, I])."""
    gate = ExpertWeights.stack([e[0] for e in experts])
    up = ExpertWeights.stack([e[1] for e in experts])
    down = ExpertWeights.stack([e[2] for e in experts])
    return FusedExperts.of([gate, up]), down


def _flat_parts(experts: list) -> list[ExpertWeights]:
    """[gate_up, down] -> the stacked tensors in the order `set_placement` walks them."""
    gate_up, down = experts
    return [*gate_up.parts, down]


def _clone(part: ExpertWeights) -> ExpertWeights:
    return ExpertWeights(part.weight.clone(), None if part.scale is None else part.scale.clone())
