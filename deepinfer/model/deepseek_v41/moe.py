"""V4.1's MoE: every layer score-routed (sqrt-softplus scores, top-k of score + bias, weights the chosen scores
renormalised and scaled), the experts and one shared expert with V4's clipped SwiGLU. No hash routing, no groups.
Image tokens would select with `bias_vl` (image input is not served yet)."""

from __future__ import annotations

import torch

from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.linear import FusedLinear
from deepinfer.model.moe import stack_experts


class V41MoE:
    def __init__(self, config: V41Config, weights, prefix: str, num_experts: int, top_k: int | None = None):
        """top_k: experts per token (default the config's num_experts_per_tok; DSpark's blocks route to fewer)."""
        self.config, self.num_experts = config, num_experts
        self.top_k = top_k or config.num_experts_per_tok
        self.router = weights.tensor(f"{prefix}gate.weight").float()
        self.bias = weights.tensor(f"{prefix}gate.bias").float()
        experts = [tuple(weights.linear(f"{prefix}experts.{e}.{w}") for w in ("w1", "w3", "w2")) for e in range(num_experts)]
        self.gate_up, self.down = stack_experts(experts)
        self.shared = (FusedLinear.of([weights.linear(f"{prefix}shared_experts.w1"), weights.linear(f"{prefix}shared_experts.w3")]),
                       weights.linear(f"{prefix}shared_experts.w2"))  # fmt: skip

    def __call__(self, ops, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        logits = ops.linear(x, self.router, fmt="dense", out_dtype=torch.float32)  # float32 weight: float32 logits of x as it is
        weights, ids = ops.gate(logits, top_k=self.top_k, score_func=c.scoring_func, correction_bias=self.bias,
                                renormalize=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor)  # fmt: skip
        expert_x, offsets, row_of_slot = ops.dispatch(x, ids, num_experts=self.num_experts)
        if expert_x.shape[0]:
            hidden = ops.clamped_silu_and_mul(self.gate_up(ops, expert_x, offsets), limit=c.swiglu_limit)
            expert_out = self.down(ops, hidden, offsets)
        else:
            expert_out = expert_x.new_empty(0, x.shape[1])
        gate_up, down = self.shared
        shared = down(ops, ops.clamped_silu_and_mul(gate_up(ops, x), limit=c.swiglu_limit))
        return ops.combine(expert_out, weights, row_of_slot, add=shared)  # added inside combine's float32 sum
