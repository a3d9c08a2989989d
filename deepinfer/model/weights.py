"""What the model expects from a checkpoint (`TensorSpec`) and how it takes its loaded tensors (`WeightStore`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model.linear import LinearWeight

# Kinds of tensors, which decide the dtype they are kept in:
LINEAR = "linear"  # a projection's `.weight`: FP8 stays FP8 (with `.weight_scale_inv`), floats take the model dtype
FLOAT32 = "float32"  # the router and its correction bias: float32, as DeepSeek and transformers keep them
PARAM = "param"  # embeddings and norm weights: the model dtype

SCALE_SUFFIX = "_scale_inv"  # `x.weight` FP8 -> `x.weight_scale_inv`: float32 multiplier per 128x128 block


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    kind: str


class WeightStore:
    """Loaded tensors by HF name; the model takes (pops) each one as it builds its layers."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._tensors = dict(tensors)

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors.pop(name)

    def linear(self, prefix: str) -> LinearWeight:
        weight = self._tensors.pop(f"{prefix}.weight")
        return LinearWeight(weight, self._tensors.pop(f"{prefix}.weight{SCALE_SUFFIX}", None))

    def take_prefix(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor under `prefix`, names relative to it."""
        names = [n for n in self._tensors if n.startswith(prefix)]
        return {n[len(prefix):]: self._tensors.pop(n) for n in names}

    def remaining(self) -> list[str]:
        return sorted(self._tensors)
