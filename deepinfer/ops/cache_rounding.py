"""DeepSeek-V4.1's cache number formats as a quantize-then-dequantize rounding of activations.

V4.1 stores its caches in low-precision formats and its reference forward (DeepSeek's released
inference code; NeMo Automodel follows it) replaces each cached value by its dequantised value at
the same boundaries, so a model that keeps its caches in a wider dtype must round exactly there to
compute the same function:
- "fp8": the window KV (every layer, after RoPE): e4m3 (clamp +-448, nearest even) with a power-of-two
  scale per 32 channels, 2^ceil(log2(max(amax, 1e-4) / 448)) taken exactly on the float32 bits;
- "nvfp4": the compressed KV (after RoPE): e2m1 with an e4m3 scale per 16 channels, e4m3(max(amax, 6 * 2^-9) / 6);
- "mxfp4": the index queries and keys (after RoPE): e2m1 with a power-of-two scale per 32 channels,
  2^ceil(log2(max(amax, 6 * 2^-126) / 6)).
e2m1: x / scale clamped to +-6, magnitude to the nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, exact midpoints to the
even code, sign kept. A last partial group is padded with zeros.
"""

from __future__ import annotations

import torch

from deepinfer.ops.sparse_attention import V41
from deepinfer.registry import EXACT, op

CACHE_FORMATS = ("fp8", "nvfp4", "mxfp4")
GROUP = {"fp8": 32, "nvfp4": 16, "mxfp4": 32}
_E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def power_of_two_ceiling(value: torch.Tensor) -> torch.Tensor:
    """Positive normal float32 values rounded up to a power of two, on their bits (no log rounding)."""
    bits = value.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 255
    carry = (bits & ((1 << 23) - 1)) != 0
    return ((exponent + carry.to(torch.int32)) << 23).view(torch.float32)


def _e2m1(normalized: torch.Tensor) -> torch.Tensor:
    magnitude = normalized.abs().contiguous()
    midpoints = magnitude.new_tensor(_E2M1_MIDPOINTS)
    levels = magnitude.new_tensor(_E2M1_LEVELS)
    lower = torch.bucketize(magnitude, midpoints)  # the level at or below each midpoint crossed
    tie = magnitude == midpoints[lower.clamp(max=len(_E2M1_MIDPOINTS) - 1)]
    chosen = lower + (tie & (lower % 2 == 1)).to(lower.dtype)  # a midpoint goes to the even code
    return torch.copysign(levels[chosen], normalized)


def quantised_groups(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] in cache format `fmt`: (the values divided by their scale and rounded to the format's grid
    [..., ceil(C / group), group] float32, the padding channels 0; each group's float32 scale [..., groups, 1]).
    Their product is the stored value (`cache_round`); the codes and scale bytes are cache_storage.py's."""
    if fmt not in CACHE_FORMATS:
        raise ValueError(f"cache format {fmt!r} is not one of {CACHE_FORMATS}")
    group = GROUP[fmt]
    padded = torch.nn.functional.pad(x.float(), (0, -x.shape[-1] % group))
    grouped = padded.unflatten(-1, (-1, group))
    amax = grouped.abs().amax(-1, keepdim=True)
    if fmt == "fp8":
        scale = power_of_two_ceiling(amax.clamp(min=1e-4) * (1 / 448))
        return (grouped / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float(), scale
    if fmt == "nvfp4":
        scale = (amax.clamp(min=6 * 2**-9) / 6).to(torch.float8_e4m3fn).float()
    else:
        scale = power_of_two_ceiling(amax.clamp(min=6 * 2**-126) * (1 / 6))
    return _e2m1((grouped / scale).clamp(-6, 6)), scale


# Bit-exact: the rounding is float32 arithmetic every backend performs alike (golden inputs sit away
# from midpoints only by chance, so a kernel that rounds differently fails here, as it should).
@op(family="misc", outputs=("out",), compare=EXACT, formats=CACHE_FORMATS, golden_precision="native", model_types=V41)
def cache_round(x: torch.Tensor, *, fmt: str) -> torch.Tensor:
    """x [..., C] replaced by its value after storing in cache format `fmt` (module doc) and reading back.

    Groups are consecutive channels of the last dimension. Computed in float32 (the formats' scales
    are float32 bit operations, defined in float32 whatever x's dtype); returns x's dtype and shape."""
    rounded, scale = quantised_groups(x, fmt)
    return (rounded * scale).flatten(-2)[..., : x.shape[-1]].to(x.dtype)
