"""Triton helpers for `cache_round` (deepinfer.ops.cache_rounding): DeepSeek-V4.1's cache formats as a
quantize-then-dequantize rounding of groups of channels, bit for bit as the reference computes them; and for
`cache_pack` / `cache_unpack` (deepinfer.ops.cache_storage), the same formats stored as code and scale bytes.

Both backends' kernels take a tile of groups ([groups, GROUP] float32, one group a row) through
`round_groups`, `pack_groups` or `unpack_groups`; they differ only in how they cut the tensor into tiles. Every step is float32
arithmetic the reference performs alike: correctly rounded divisions (`tl.math.div_rn`, as torch's),
power-of-two scales taken on the float32 bits (no log2), e4m3 by integer rounding
(`deepinfer.triton_common.e4m3_rne_bits`: the interpreter's float8 cast truncates and Ascend A2/A3
have no float8 type), e2m1 by comparisons with its midpoints (ties to the even code), the sign copied
bit for bit (-0.0 stays -0.0, as torch.copysign gives). Backend-neutral like `deepinfer.triton_common`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.cache_rounding import GROUP
from deepinfer.ops.cache_storage import check_unpack_args, row_bytes
from deepinfer.triton_common import cdiv, e4m3_bits_to_f32, e4m3_rne_bits


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
def group_scale(amax, FMT: tl.constexpr):
    """Each group's float32 scale from its amax (the reference's formulas)."""
    if FMT == "fp8":
        scale = power_of_two_ceiling(tl.maximum(amax, 1e-4) * (1 / 448))
    elif FMT == "nvfp4":
        scale = e4m3_bits_to_f32(e4m3_rne_bits(tl.math.div_rn(tl.maximum(amax, 6 * 2**-9), 6.0)))
    else:
        scale = power_of_two_ceiling(tl.maximum(amax, 6 * 2**-126) * (1 / 6))
    return scale


@triton.jit
def round_groups(x, FMT: tl.constexpr):
    """x [groups, GROUP] float32 (padding channels 0) after storing in cache format FMT ("fp8", "nvfp4",
    "mxfp4") and reading back, each row one group with its own scale (the reference's formulas)."""
    scale = group_scale(tl.max(tl.abs(x), axis=1), FMT)
    if FMT == "fp8":
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0)
        rounded = e4m3_bits_to_f32(e4m3_rne_bits(q))  # (the sign kept: -0.0 too)
    else:
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -6.0), 6.0)
        rounded = e2m1_round(q)
    return rounded * scale[:, None]


# ---- the stored formats (deepinfer.ops.cache_storage): codes, then one scale byte per group


@triton.jit
def e2m1_code(v):
    """The e2m1 code (int32 0..15: sign bit 3, the magnitude's index in {0, .5, 1, 1.5, 2, 3, 4, 6}) of v
    (|v| <= 6), rounded as `e2m1_round` rounds; -0.0 keeps its sign bit."""
    m = tl.abs(v)
    index = (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32) + (m >= 1.75).to(tl.int32)
    index += (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32)
    return index | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def e2m1_value(code):
    """The float32 value of e2m1 codes (int32 0..15)."""
    index = code & 7
    magnitude = tl.where(index < 4, index.to(tl.float32) * 0.5, tl.where(index == 7, 6.0, (index - 2).to(tl.float32)))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def scale_byte(scale, FMT: tl.constexpr):
    """A group's scale as its stored byte (int32): e4m3 for nvfp4, the e8m0 exponent otherwise."""
    if FMT == "nvfp4":
        b = e4m3_rne_bits(scale)  # exact: the scale is an e4m3 value
    else:
        b = scale.to(tl.int32, bitcast=True) >> 23
    return b


@triton.jit
def byte_scale(b, FMT: tl.constexpr):
    """A stored scale byte (int32) as its float32 value."""
    if FMT == "nvfp4":
        s = e4m3_bits_to_f32(b)
    else:
        s = (b << 23).to(tl.float32, bitcast=True)
    return s


@triton.jit
def pack_groups(x_ptr, rows_ptr, g, n_groups, groups_per_row, C, stride_x, W, FMT: tl.constexpr, GROUP: tl.constexpr):
    """Quantise the groups g ([BLOCK_G] ids, row-major over rows of C channels) of x into stored rows of W
    bytes (codes at the group's channels, the scale byte at C (fp8) or C / 2 (fp4) plus the group's index)."""
    row = g // groups_per_row
    in_row = g % groups_per_row
    col = in_row * GROUP
    live = g < n_groups
    x_rows = x_ptr + row[:, None] * stride_x
    dst = rows_ptr + row * W
    if FMT == "fp8":
        j = tl.arange(0, GROUP)
        ok = live[:, None] & ((col[:, None] + j[None, :]) < C)
        x = tl.load(x_rows + col[:, None] + j[None, :], mask=ok, other=0.0).to(tl.float32)
        scale = group_scale(tl.max(tl.abs(x), axis=1), FMT)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0)
        tl.store(dst[:, None] + col[:, None] + j[None, :], e4m3_rne_bits(q).to(tl.uint8), mask=ok)
        tl.store(dst + C + in_row, scale_byte(scale, FMT).to(tl.uint8), mask=live)
    else:  # the even and the odd channels of each group as two tiles: their codes share a byte
        j = tl.arange(0, GROUP // 2)
        ok = live[:, None] & ((col[:, None] + 2 * j[None, :]) < C)  # C is even: a pair is whole or absent
        even = tl.load(x_rows + col[:, None] + 2 * j[None, :], mask=ok, other=0.0).to(tl.float32)
        odd = tl.load(x_rows + col[:, None] + 2 * j[None, :] + 1, mask=ok, other=0.0).to(tl.float32)
        scale = group_scale(tl.maximum(tl.max(tl.abs(even), axis=1), tl.max(tl.abs(odd), axis=1)), FMT)
        low = e2m1_code(tl.minimum(tl.maximum(tl.math.div_rn(even, scale[:, None]), -6.0), 6.0))
        high = e2m1_code(tl.minimum(tl.maximum(tl.math.div_rn(odd, scale[:, None]), -6.0), 6.0))
        tl.store(dst[:, None] + col[:, None] // 2 + j[None, :], (low | (high << 4)).to(tl.uint8), mask=ok)
        tl.store(dst + C // 2 + in_row, scale_byte(scale, FMT).to(tl.uint8), mask=live)


@triton.jit
def unpack_groups(rows_ptr, g, n_groups, groups_per_row, C, W, FMT: tl.constexpr, GROUP: tl.constexpr):
    """The float32 values of the groups g of stored rows (W bytes each, C channels), with the offsets of
    their channels in a [rows, C] output and the mask of real channels: (values, offsets, mask)."""
    row = g // groups_per_row
    in_row = g % groups_per_row
    col = in_row * GROUP
    j = tl.arange(0, GROUP)
    ok = (g < n_groups)[:, None] & ((col[:, None] + j[None, :]) < C)
    src = rows_ptr + row * W
    if FMT == "fp8":
        value = e4m3_bits_to_f32(tl.load(src[:, None] + col[:, None] + j[None, :], mask=ok, other=0).to(tl.int32))
        b = tl.load(src + C + in_row, mask=g < n_groups, other=127).to(tl.int32)
    else:
        byte = tl.load(src[:, None] + (col[:, None] + j[None, :]) // 2, mask=ok, other=0).to(tl.int32)
        value = e2m1_value((byte >> ((j[None, :] % 2) * 4)) & 15)
        b = tl.load(src + C // 2 + in_row, mask=g < n_groups, other=127).to(tl.int32)
    return value * byte_scale(b, FMT)[:, None], row[:, None] * C + col[:, None] + j[None, :], ok


# ---- the host side of the cuda and ascend cache_pack / cache_unpack kernels: the rows and groups they walk


def pack_layout(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(x as rows [R, C] with unit channel stride, the stored rows to fill uint8 [..., row_bytes(C, fmt)], groups per
    row, groups in all) for a cache_pack kernel."""
    channels = x.shape[-1]
    out = torch.empty(*x.shape[:-1], row_bytes(channels, fmt), dtype=torch.uint8, device=x.device)
    rows = x.reshape(-1, channels)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    groups_per_row = cdiv(channels, GROUP[fmt])
    return rows, out, groups_per_row, rows.shape[0] * groups_per_row


def unpack_layout(rows: torch.Tensor, out: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(the stored rows flat [R, W] and contiguous, the output to write (out itself when contiguous, else a contiguous
    twin to copy into out after), groups per row, groups in all) for a cache_unpack kernel; checks the shapes."""
    check_unpack_args(rows, out, fmt)
    flat_rows = rows.reshape(-1, rows.shape[-1]).contiguous()
    dense = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    groups_per_row = cdiv(out.shape[-1], GROUP[fmt])
    return flat_rows, dense, groups_per_row, flat_rows.shape[0] * groups_per_row
