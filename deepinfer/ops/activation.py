"""The gated activation of DeepSeek's MLPs and experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.registry import ALLCLOSE, op


@op(family="misc", outputs=("out",), compare=ALLCLOSE)
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] holding gate then up. Returns `silu(gate) * up`: [T, I], x's dtype, computed in float32."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    gate, up = x.to(acc).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


@op(family="misc", outputs=("out",), compare=ALLCLOSE, model_types=("deepseek_v4", "deepseek_v41"))
def clamped_silu_and_mul(x: torch.Tensor, *, limit: float) -> torch.Tensor:
    """DeepSeek-V4's clipped SwiGLU: x [T, 2I] holding gate then up; returns
    `silu(min(gate, limit)) * clamp(up, -limit, limit)`: [T, I], x's dtype, computed in float32."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    gate, up = x.to(acc).chunk(2, dim=-1)
    return (F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)).to(x.dtype)
