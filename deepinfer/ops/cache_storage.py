"""DeepSeek-V4.1's caches in their released storage formats: rows of bytes, written and read by two ops.

A row of C channels in cache format `fmt` (cache_rounding.py's formats; G = ceil(C / group) scale groups) is
uint8 [row_bytes(C, fmt)]: the codes, then one scale byte per group:
- "fp8" (window KV): C e4m3 bytes, then G e8m0 bytes (2^(e - 127)): 512 + 16 = 528 bytes for a 512-wide row;
- "nvfp4" (compressed KV): C / 2 bytes of e2m1 codes, two a byte (the even channel in the low nibble, code =
  sign bit 3 + the magnitude's index in {0, .5, 1, 1.5, 2, 3, 4, 6}, as the release's FP4 weights), then G
  e4m3 scale bytes: 256 + 32 = 288 bytes;
- "mxfp4" (index keys): C / 2 code bytes, then G e8m0 bytes: 64 + 4 = 68 bytes for a 128-wide key.
These are the release's (and ATOM's) row sizes. `cache_pack` quantises rows into the format, `cache_unpack`
reads them back: unpack(pack(x)) is `cache_round(x)` bit for bit, so a model that stores bytes computes what one
that stores rounded values computes. The readers of the caches (sparse_attention, the indexer ops) take values:
the model unpacks what a step reads (deepinfer.model.deepseek_v41.caches).
"""

from __future__ import annotations

import torch

from deepinfer.ops.cache_rounding import CACHE_FORMATS, GROUP, quantised_groups
from deepinfer.ops.quant import E2M1_VALUES, e2m1_codes
from deepinfer.ops.sparse_attention import V41
from deepinfer.registry import EXACT, op

FP4_FORMATS = ("nvfp4", "mxfp4")  # two codes a byte


def row_bytes(channels: int, fmt: str) -> int:
    """Bytes of one stored row of `channels` values in cache format `fmt`."""
    if fmt not in CACHE_FORMATS:
        raise ValueError(f"cache format {fmt!r} is not one of {CACHE_FORMATS}")
    if fmt in FP4_FORMATS and channels % 2:
        raise ValueError(f"an {fmt} row packs two channels a byte: it needs an even channel count, got {channels}")
    return (channels // 2 if fmt in FP4_FORMATS else channels) + -(-channels // GROUP[fmt])


def check_unpack_args(rows: torch.Tensor, out: torch.Tensor, fmt: str) -> None:
    """cache_unpack's rows must be uint8 [..., row_bytes(C, fmt)] beside out [..., C]: a ValueError naming both otherwise
    (every backend's kernel checks through here)."""
    width = row_bytes(out.shape[-1], fmt)
    if rows.dtype != torch.uint8 or rows.shape[:-1] != out.shape[:-1] or rows.shape[-1] != width:
        raise ValueError(f"cache_unpack wants rows uint8 [..., {width}] for out {tuple(out.shape)} in {fmt}, got {rows.dtype} {tuple(rows.shape)}")


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    """The exponent byte of power-of-two float32 scales (2^-126 .. 2^127)."""
    return (scale.contiguous().view(torch.int32) >> 23).to(torch.uint8)


def _fp4_codes(values: torch.Tensor) -> torch.Tensor:
    """e2m1 codes of values on the e2m1 grid (sign bit kept, -0.0 included)."""
    table = values.new_tensor(E2M1_VALUES)
    index = torch.bucketize(values.abs(), table)  # exact: every magnitude is a level
    return (index | torch.where(torch.signbit(values), 8, 0)).to(torch.uint8)


@op(family="misc", outputs=("rows",), compare=EXACT, formats=CACHE_FORMATS, golden_precision="native", model_types=V41)
def cache_pack(x: torch.Tensor, *, fmt: str) -> torch.Tensor:
    """x [..., C] as stored rows uint8 [..., row_bytes(C, fmt)] (module doc), quantised as `cache_round`
    rounds (in float32 whatever x's dtype)."""
    channels = x.shape[-1]
    width = row_bytes(channels, fmt)
    rounded, scale = quantised_groups(x, fmt)
    values = rounded.flatten(-2)[..., :channels]
    if fmt == "fp8":
        codes = values.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        pairs = _fp4_codes(values).unflatten(-1, (-1, 2))
        codes = pairs[..., 0] | (pairs[..., 1] << 4)
    scale_bytes = scale[..., 0].to(torch.float8_e4m3fn).view(torch.uint8) if fmt == "nvfp4" else _e8m0(scale[..., 0])
    rows = torch.cat((codes, scale_bytes), dim=-1)
    assert rows.shape[-1] == width
    return rows


@op(family="misc", outputs=("out",), compare=EXACT, formats=CACHE_FORMATS, golden_precision="native", in_place="out", model_types=V41)
def cache_unpack(rows: torch.Tensor, out: torch.Tensor, *, fmt: str) -> torch.Tensor:
    """Stored rows uint8 [..., row_bytes(C, fmt)] read back into out [..., C] (its dtype): each code times
    its group's scale in float32, then cast. Returns out."""
    check_unpack_args(rows, out, fmt)
    channels = out.shape[-1]
    group = GROUP[fmt]
    width = channels if fmt == "fp8" else channels // 2
    codes, scale_bytes = rows[..., :width], rows[..., width:]
    if fmt == "fp8":
        values = codes.contiguous().view(torch.float8_e4m3fn).float()
    else:
        fp4 = e2m1_codes(codes).long()
        values = out.new_tensor(E2M1_VALUES, dtype=torch.float32)[fp4 & 7]
        values = torch.where(fp4 >= 8, -values, values)
    if fmt == "nvfp4":
        scale = scale_bytes.contiguous().view(torch.float8_e4m3fn).float()
    else:
        scale = (scale_bytes.to(torch.int32) << 23).view(torch.float32)  # 2^(e - 127), e >= 1
    padded = torch.nn.functional.pad(values, (0, -channels % group)).unflatten(-1, (-1, group))
    out.copy_((padded * scale[..., None]).flatten(-2)[..., :channels])
    return out


__all__ = ["FP4_FORMATS", "row_bytes", "cache_pack", "cache_unpack"]
