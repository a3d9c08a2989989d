"""Rotary position embedding, in DeepSeek's interleaved layout and the half (NeoX) layout, with YaRN.

The op rotates; `rope_cos_sin_cache` builds the table it reads (plain RoPE or YaRN), once per model.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from deepinfer.registry import ALLCLOSE, op


@op(family="misc", outputs=("out",), compare=ALLCLOSE, reduction_length=lambda kw: 2)
def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    interleaved: bool = True,
) -> torch.Tensor:
    """Rotate x: [T, H, D] (D even, the rotary dims only) by each token's position.

    positions: [T] int64. cos_sin_cache: [max_positions, D] float32, row p = (cos(p*f_0..f_{D/2-1}),
    sin(p*f_0..f_{D/2-1})). interleaved=True rotates adjacent pairs (x[2i], x[2i+1]) by angle p*f_i
    (DeepSeek's layout); False rotates (x[i], x[i+D/2]) (NeoX/HF rotate_half layout). Computed in
    float32 (float64 for float64 inputs); returns x's dtype and layout.
    """
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = x.shape[-1] // 2
    cs = cos_sin_cache.to(acc)[positions.long()]  # [T, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    xf = x.to(acc)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    else:
        a, b = xf[..., :half], xf[..., half:]
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    return out.to(x.dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_cos_sin_cache(
    rot_dim: int,
    max_positions: int,
    base: float,
    scaling: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The [max_positions, rot_dim] table `rope` reads: cos half then sin half.

    `scaling` is the HF `rope_scaling` / `rope_parameters` dict. With `type`/`rope_type` "yarn" the
    frequencies are blended between interpolation and extrapolation over the correction range
    (beta_fast, beta_slow), and cos/sin carry YaRN's attention factor
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1.0 for DeepSeek's configs, whose
    mscale lives in the softmax scale instead).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    attention_factor = 1.0
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "yarn":
        factor = float(scaling["factor"])
        original = int(scaling.get("original_max_position_embeddings", max_positions))
        beta_fast = float(scaling.get("beta_fast", 32.0))
        beta_slow = float(scaling.get("beta_slow", 1.0))

        def correction_dim(rotations: float) -> float:
            return (rot_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), rot_dim - 1)
        if low == high:
            high += 0.001  # no division by zero: the ramp degenerates to a step
        ramp = ((torch.arange(rot_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
        attention_factor = scaling.get("attention_factor") or (
            yarn_mscale(factor, float(scaling.get("mscale", 1.0))) / yarn_mscale(factor, float(scaling.get("mscale_all_dim", 0.0)))
            if scaling.get("mscale_all_dim")
            else yarn_mscale(factor)
        )
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: yarn, default)")
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos() * attention_factor, angles.sin() * attention_factor), dim=-1).to(dtype)
