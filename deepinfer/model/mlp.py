"""The dense MLP of the first layers (and the shared experts): down(silu(gate x) * up x)."""

from __future__ import annotations

import torch

from deepinfer.model.linear import FusedLinear
from deepinfer.model.weights import LINEAR, TensorSpec, WeightStore


def mlp_specs(hidden: int, intermediate: int, prefix: str) -> dict[str, TensorSpec]:
    return {
        f"{prefix}gate_proj.weight": TensorSpec((intermediate, hidden), LINEAR),
        f"{prefix}up_proj.weight": TensorSpec((intermediate, hidden), LINEAR),
        f"{prefix}down_proj.weight": TensorSpec((hidden, intermediate), LINEAR),
    }


class DenseMLP:
    def __init__(self, weights: WeightStore, prefix: str):
        # gate and up concatenated: one product, then silu_and_mul reads gate then up
        self.gate_up = FusedLinear.of([weights.linear(f"{prefix}gate_proj"), weights.linear(f"{prefix}up_proj")])
        self.down = weights.linear(f"{prefix}down_proj")

    def __call__(self, ops, x: torch.Tensor) -> torch.Tensor:
        return self.down(ops, ops.silu_and_mul(self.gate_up(ops, x)))
