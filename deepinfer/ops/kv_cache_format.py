"""The KV cache's row formats: the model dtype, or FP8 e4m3 with one scale per token (`kv_cache_dtype="fp8"`).

A cache row holds one token's values (MLA: the 512 latent + 64 rope channels; V4: the 512-wide
window KV, compressed entry or 128-wide indexer key; W a multiple of 16). In the FP8 format the row
is `W + 16` bytes in a float8_e4m3fn tensor: the W values quantised to e4m3, then the row's float32
scale, little-endian, in the next 4 bytes, then 12 zero bytes that keep every row 16-byte aligned
(the kernels' vector loads need it: 580-byte rows were read byte by byte, 5x slower than bf16's on
the H200). FlashMLA's FP8 cache also keeps the scales inline in the row, so a page stays one
contiguous tensor and every kernel finds a token's scale next to it:

    scale = max(amax(|row|), 1e-4) / 448      (float32, IEEE division)
    q     = round_to_nearest_even(row / scale) as e4m3     value = q * scale

One scale per token (not per channel group) keeps the row small: 592 bytes per MLA token against
1152 in bfloat16 (51.4%), 528 against 1024 for a V4 row (51.6%), 144 against 256 for a V4 indexer
key. Quantisation is in float32 whatever the input's precision. The rope channels share the row's
scale (DeepSeek V3.2's FlashMLA keeps them in bfloat16 instead, at 656 bytes a token); the readers'
conformance cases say what that costs.
"""

from __future__ import annotations

import torch

from deepinfer.ops.quant import AMAX_FLOOR, FP8_DTYPE, FP8_MAX

SCALE_BYTES = 4  # the float32 scale after an FP8 row's values
ROW_TAIL = 16  # bytes after the values: the scale, then zeros up to a 16-byte multiple
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; "fp8" means e4m3
LAYOUT_VERSION = 1  # bump when a row's bytes change meaning: KV kept outside the process (deepinfer.kv_tiers) is keyed by it


def is_fp8(cache: torch.Tensor | torch.dtype) -> bool:
    dtype = cache if isinstance(cache, torch.dtype) else cache.dtype
    return dtype == FP8_DTYPE


def row_width(values: int, dtype: torch.dtype) -> int:
    """Elements of a cache row holding `values` values in a cache of `dtype`."""
    if not is_fp8(dtype):
        return values
    if values % ROW_TAIL:
        raise ValueError(f"an FP8 KV cache needs rows of a multiple of {ROW_TAIL} values, got {values}; use kv_cache_dtype='auto'")
    return values + ROW_TAIL


def value_width(cache: torch.Tensor) -> int:
    """Values per row of a cache (its last dimension, less the FP8 row's tail)."""
    return cache.shape[-1] - ROW_TAIL if is_fp8(cache) else cache.shape[-1]


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for a `kv_cache_dtype` setting ("auto": the model's)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else FP8_DTYPE


def quantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows [..., W] (any float dtype, W a multiple of 16) -> FP8 rows [..., W + 16] float8_e4m3fn, the layout above."""
    row_width(rows.shape[-1], FP8_DTYPE)  # (checks W)
    x = rows.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    values = (x / scale).to(FP8_DTYPE)
    scale_bytes = scale.flatten().view(torch.uint8).view(FP8_DTYPE).view(*scale.shape[:-1], SCALE_BYTES)  # little-endian float32
    padding = torch.zeros(*scale.shape[:-1], ROW_TAIL - SCALE_BYTES, dtype=FP8_DTYPE, device=rows.device)
    return torch.cat((values, scale_bytes, padding), dim=-1)


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scale of each FP8 row [..., W + 16] -> [..., 1]."""
    start = rows.shape[-1] - ROW_TAIL
    return rows[..., start : start + SCALE_BYTES].contiguous().view(torch.uint8).view(torch.float32)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of a cache as values [..., W] in `dtype`: FP8 rows dequantised (in float32, float64 when
    asked), other rows cast."""
    if not is_fp8(rows):
        return rows.to(dtype)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    values = rows[..., : rows.shape[-1] - ROW_TAIL].to(compute) * row_scales(rows).to(compute)
    return values.to(dtype)
