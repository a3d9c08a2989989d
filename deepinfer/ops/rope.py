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


def check_head_norm_rope_args(x, positions, cos_sin_cache) -> None:
    """`head_norm_rope`'s shapes (no host synchronisation): every backend's check."""
    if x.dim() != 3:
        raise ValueError(f"head_norm_rope wants x [T, H, D], got {tuple(x.shape)}")
    rope_dim = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rope_dim % 2 or rope_dim > x.shape[-1] or x.shape[-1] % 2:
        raise ValueError(f"cos_sin_cache must be [max_positions, R], R even and at most D={x.shape[-1]} (even), got {tuple(cos_sin_cache.shape)}")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"positions must be [T={x.shape[0]}], got {tuple(positions.shape)}")


# Normalised heads (magnitude ~1) and rope channels that sum two products: rope's length.
@op(family="misc", outputs=("x",), compare=ALLCLOSE, reduction_length=lambda kw: 2, in_place="x", model_types=("deepseek_v4",))
def head_norm_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    eps: float | None = None,
) -> torch.Tensor:
    """Each head of x RMS-normed without weight (when eps is given), then its last R channels rotated, in place.

    x: [T, H, D] (D even; its last dimension contiguous), written in place and returned; positions: [T]
    int64; cos_sin_cache: [max_positions, R] float32 (`rope`'s table, R even, R <= D). With eps, row
    x[t, h] becomes n = x / sqrt(mean(x^2) + eps) (`rms_norm` with a weight of ones), rounded to x's
    dtype; without (None), n = x. Then n's last R channels are rotated in DeepSeek's interleaved pairs
    at positions[t] (`rope`, interleaved=True) and rounded again. So the result is bit for bit what
    rms_norm, rope on the tail and a copy back give on this backend. Computed in float32 (float64 for
    float64 x).

    Why an op of its own: DeepSeek-V4's query heads are normed without weight and rotated on their
    tail (and the indexer's query heads rotated only), each a launch of its own plus a copy of the
    rotated tail back into the head. `rope` reads only the R rotary channels, so it cannot norm the
    head, and `rms_norm` has neither positions nor a table; this op reads each head once, in place.
    """
    check_head_norm_rope_args(x, positions, cos_sin_cache)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    if eps is not None:
        xf = x.to(acc)
        x.copy_((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype))
    tail = x[..., x.shape[-1] - cos_sin_cache.shape[-1] :]
    tail.copy_(rope(tail, positions, cos_sin_cache, interleaved=True))
    return x


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(rot_dim: int, base: float, scaling: Mapping[str, Any] | None = None) -> tuple[torch.Tensor, float]:
    """Per-pair frequencies (float64, [rot_dim/2]) and the factor cos/sin are multiplied by.

    `scaling` is the HF `rope_scaling` / `rope_parameters` dict. With `type`/`rope_type` "yarn" the
    frequencies are blended between interpolation and extrapolation over the correction range
    (beta_fast, beta_slow), and the factor is YaRN's attention factor
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1.0 for DeepSeek's configs, whose
    mscale lives in the softmax scale instead).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        return inv_freq, 1.0
    if kind != "yarn":
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: yarn, default)")
    factor = float(scaling["factor"])
    if not scaling.get("original_max_position_embeddings"):
        raise ValueError("yarn rope scaling needs original_max_position_embeddings (the pre-extension context length)")
    original = int(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32.0)
    beta_slow = float(scaling.get("beta_slow") or 1.0)

    def correction_dim(rotations: float) -> float:
        # log(original / (rotations 2 pi)) as a difference of logs: the quotient overflows to inf for a
        # tiny beta and a huge original length (finite config values), the difference never does
        return (rot_dim * (math.log(original) - math.log(rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rot_dim - 1)
    if low == high:
        high += 0.001  # no division by zero: the ramp degenerates to a step
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim)) if mscale and mscale_all_dim else yarn_mscale(factor)
    return inv_freq, float(attention_factor)


def rope_cos_sin_cache(
    rot_dim: int,
    max_positions: int,
    base: float,
    scaling: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The [max_positions, rot_dim] table `rope` reads: cos half then sin half (see `rope_inv_freq`)."""
    inv_freq, attention_factor = rope_inv_freq(rot_dim, base, scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos() * attention_factor, angles.sin() * attention_factor), dim=-1).to(dtype)
