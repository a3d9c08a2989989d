"""Triton helpers for `cache_round` (deepinfer.ops.cache_rounding): DeepSeek-V4.1's cache formats as a
quantize-then-dequantize rounding of groups of channels, bit for bit as the reference computes them.

Both backends' kernels round a tile of groups ([groups, GROUP] float32, one group a row) with
`round_groups`; they differ only in how they cut the tensor into tiles. Every step is float32
arithmetic the reference performs alike: correctly rounded divisions (`tl.math.div_rn`, as torch's),
power-of-two scales taken on the float32 bits (no log2), e4m3 by integer rounding
(`deepinfer.triton_common.e4m3_rne_bits`: the interpreter's float8 cast truncates and Ascend A2/A3
have no float8 type), e2m1 by comparisons with its midpoints (ties to the even code), the sign copied
bit for bit (-0.0 stays -0.0, as torch.copysign gives). Backend-neutral like `deepinfer.triton_common`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.triton_common import e4m3_bits_to_f32, e4m3_rne_bits


@triton.jit
def power_of_two_ceiling(v):
    """Positive normal float32 v rounded up to a power of two: the exponent plus one when any mantissa bit is set."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 255
    carry = ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return ((exponent + carry) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_round(v):
    """v (|v| <= 6) to the nearest e2m1 value {0, .5, 1, 1.5, 2, 3, 4, 6} with v's sign; a midpoint goes to
    the even code: strictly past the midpoints below an even code (.25, 1.25, 2.5, 5), at or past those
    below an odd one (.75, 1.75, 3.5). The increments add exactly in float32."""
    m = tl.abs(v)
    level = 0.5 * (m > 0.25).to(tl.float32) + 0.5 * (m >= 0.75).to(tl.float32)
    level += 0.5 * (m > 1.25).to(tl.float32) + 0.5 * (m >= 1.75).to(tl.float32)
    level += (m > 2.5).to(tl.float32) + (m >= 3.5).to(tl.float32) + 2.0 * (m > 5.0).to(tl.float32)
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (level.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_groups(x, FMT: tl.constexpr):
    """x [groups, GROUP] float32 (padding channels 0) after storing in cache format FMT ("fp8", "nvfp4",
    "mxfp4") and reading back, each row one group with its own scale (the reference's formulas)."""
    amax = tl.max(tl.abs(x), axis=1)
    if FMT == "fp8":
        scale = power_of_two_ceiling(tl.maximum(amax, 1e-4) * (1 / 448))
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0)
        rounded = e4m3_bits_to_f32(e4m3_rne_bits(q))  # (the sign kept: -0.0 too)
    else:
        if FMT == "nvfp4":
            scale = e4m3_bits_to_f32(e4m3_rne_bits(tl.math.div_rn(tl.maximum(amax, 6 * 2**-9), 6.0)))
        else:
            scale = power_of_two_ceiling(tl.maximum(amax, 6 * 2**-126) * (1 / 6))
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -6.0), 6.0)
        rounded = e2m1_round(q)
    return rounded * scale[:, None]
