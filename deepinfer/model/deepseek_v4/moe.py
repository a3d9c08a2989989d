"""V4 MoE: routed experts (hash routing in the first layers, then scored top-k) plus a shared expert,
every SwiGLU clipped at `swiglu_limit`.

Hash layers take each token's experts from a frozen table (`tid2eid[token id]`, looked up by the
`gate` op); the router's sqrt(softplus) scores still weigh them. Scored layers pick the top-k of score + bias (`gate`).
Weights are renormalised and scaled by routed_scaling_factor in both.
"""

from __future__ import annotations

import torch

from deepinfer.model.deepseek_v4.config import HASH_MOE, V4Config
from deepinfer.model.linear import FusedLinear
from deepinfer.model.moe import stack_experts
from deepinfer.model.weights import FLOAT32, LINEAR, TensorSpec, WeightStore

INDEX = "index"  # an integer table (tid2eid), kept as int64
EXPERT = "expert"  # a routed expert's projection: dense, FP8 block-scaled, or MXFP4 (packed) as stored


def moe_specs(config: V4Config, layer: int, prefix: str) -> dict[str, TensorSpec]:
    c = config
    hidden, inter = c.hidden_size, c.moe_intermediate_size
    specs = {f"{prefix}gate.weight": TensorSpec((c.n_routed_experts, hidden), FLOAT32)}
    if c.mlp_layer_types[layer] == HASH_MOE:
        specs[f"{prefix}gate.tid2eid"] = TensorSpec((c.vocab_size, c.num_experts_per_tok), INDEX)
    else:
        specs[f"{prefix}gate.bias"] = TensorSpec((c.n_routed_experts,), FLOAT32)
    for e in range(c.n_routed_experts):
        specs[f"{prefix}experts.{e}.w1.weight"] = TensorSpec((inter, hidden), EXPERT)
        specs[f"{prefix}experts.{e}.w3.weight"] = TensorSpec((inter, hidden), EXPERT)
        specs[f"{prefix}experts.{e}.w2.weight"] = TensorSpec((hidden, inter), EXPERT)
    if c.n_shared_experts:
        shared = inter * c.n_shared_experts
        specs[f"{prefix}shared_experts.w1.weight"] = TensorSpec((shared, hidden), LINEAR)
        specs[f"{prefix}shared_experts.w3.weight"] = TensorSpec((shared, hidden), LINEAR)
        specs[f"{prefix}shared_experts.w2.weight"] = TensorSpec((hidden, shared), LINEAR)
    return specs


class V4MoE:
    def __init__(self, config: V4Config, layer: int, weights: WeightStore, prefix: str):
        c = self.config = config
        self.limit = c.swiglu_limit
        self.router = weights.tensor(f"{prefix}gate.weight")
        self.hashed = c.mlp_layer_types[layer] == HASH_MOE
        self.tid2eid = weights.tensor(f"{prefix}gate.tid2eid") if self.hashed else None
        self.bias = None if self.hashed else weights.tensor(f"{prefix}gate.bias")
        experts = [tuple(weights.linear(f"{prefix}experts.{e}.{w}") for w in ("w1", "w3", "w2")) for e in range(c.n_routed_experts)]
        self.gate_up, self.down = stack_experts(experts)
        self.shared = None
        if c.n_shared_experts:
            self.shared = (FusedLinear.of([weights.linear(f"{prefix}shared_experts.w1"), weights.linear(f"{prefix}shared_experts.w3")]),
                           weights.linear(f"{prefix}shared_experts.w2"))  # fmt: skip

    def _route(self, ops, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids) per token: the gate selects by score + bias, or, hash-routed, looks the
        experts up in tid2eid by token id (in the gate's kernel) and weighs them by their scores."""
        c = self.config
        logits = ops.linear(x, self.router, fmt="dense", out_dtype=torch.float32)  # float32 weight: float32 logits of x as it is
        hashed = {"hash_table": self.tid2eid, "token_ids": input_ids} if self.hashed else {"correction_bias": self.bias}
        return ops.gate(logits, top_k=c.num_experts_per_tok, score_func=c.scoring_func, renormalize=True,
                        routed_scaling_factor=c.routed_scaling_factor, **hashed)  # fmt: skip

    def __call__(self, ops, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self._route(ops, x, input_ids)
        expert_x, offsets, row_of_slot = ops.dispatch(x, ids, num_experts=self.config.n_routed_experts)
        if expert_x.shape[0]:
            hidden = ops.clamped_silu_and_mul(self.gate_up(ops, expert_x, offsets), limit=self.limit)
            expert_out = self.down(ops, hidden, offsets)
        else:
            expert_out = expert_x.new_empty(0, x.shape[1])
        shared = None
        if self.shared is not None:  # added inside combine's float32 sum (one rounding, no launch of its own)
            gate_up, down = self.shared
            shared = down(ops, ops.clamped_silu_and_mul(gate_up(ops, x), limit=self.limit))
        return ops.combine(expert_out, weights, row_of_slot, add=shared)

