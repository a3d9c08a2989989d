"""DeepSeek's mixture of experts: router -> gate -> dispatch -> experts -> combine, plus shared experts."""

from __future__ import annotations

import torch

from deepinfer.model.config import ModelConfig
from deepinfer.model.linear import ExpertWeights, FusedExperts
from deepinfer.model.mlp import DenseMLP, mlp_specs
from deepinfer.model.weights import FLOAT32, LINEAR, TensorSpec, WeightStore


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


class MoE:
    def __init__(self, config: ModelConfig, weights: WeightStore, prefix: str):
        c = self.config = config
        self.num_experts = c.n_routed_experts
        self.router = weights.tensor(f"{prefix}gate.weight")  # [E, H] float32
        self.correction_bias = weights.tensor(f"{prefix}gate.e_score_correction_bias") if c.uses_correction_bias else None
        experts = range(self.num_experts)

        def stacked(name: str) -> ExpertWeights:
            return ExpertWeights.stack([weights.linear(f"{prefix}experts.{e}.{name}") for e in experts])

        self.gate_up = FusedExperts.of([stacked("gate_proj"), stacked("up_proj")])  # [E, 2I, H]
        self.down = stacked("down_proj")  # [E, H, I]
        self.shared = DenseMLP(weights, f"{prefix}shared_experts.") if c.n_shared_experts else None
        self.n_group, self.topk_group = c.routing_groups

    def __call__(self, ops, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        logits = ops.linear(x.float(), self.router, fmt="dense")  # the router runs in float32
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
        expert_x, expert_offsets, row_of_slot = ops.dispatch(x, topk_ids, num_experts=self.num_experts)
        hidden = ops.silu_and_mul(self.gate_up(ops, expert_x, expert_offsets))
        out = ops.combine(self.down(ops, hidden, expert_offsets), topk_weights, row_of_slot)
        if self.shared is not None:
            out = out + self.shared(ops, x)
        return out
