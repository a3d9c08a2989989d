"""The FP8 KV cache row format (deepinfer.ops.kv_cache_format): layout, accuracy and sizes."""

from __future__ import annotations

import struct

import pytest
import torch

from deepinfer.ops import kv_cache_format as fmt


def test_row_is_e4m3_values_then_the_float32_scale_little_endian():
    row = torch.tensor([[1.0, -2.0, 0.5, 448.0 * 3] + [0.0] * 12])
    q = fmt.quantize_rows(row)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (1, 32)  # 16 values, the scale, 12 zero bytes
    scale = struct.unpack("<f", bytes(q[0, 16:20].view(torch.uint8).tolist()))[0]
    assert scale == pytest.approx(3.0)
    assert q[0, 20:].view(torch.uint8).tolist() == [0] * 12
    assert q[0, :4].float().tolist() == [0.34375, -0.6875, 0.171875, 448.0]  # the e4m3 values nearest 1/3, -2/3, 1/6, 448
    assert fmt.row_scales(q).item() == scale


def test_round_trip_error_is_e4m3_rounding_of_the_row_scaled_to_448():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 576, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    back = fmt.dequantize_rows(fmt.quantize_rows(rows))
    scale = rows.abs().amax(dim=-1, keepdim=True) / 448
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value for normals (>= 2^-6 * scale),
    # and half the subnormal step 2^-10 * scale below that.
    bound = torch.maximum(rows.abs() * 2.0**-4, scale * 2.0**-10)
    assert ((back - rows).abs() <= bound * (1 + 1e-6)).all()


def test_zero_rows_keep_a_finite_scale_and_dequantise_to_zero():
    q = fmt.quantize_rows(torch.zeros(3, 16, dtype=torch.bfloat16))
    assert torch.isfinite(fmt.row_scales(q)).all()
    assert (fmt.dequantize_rows(q) == 0).all()


def test_widths_and_dtypes():
    assert fmt.row_width(576, torch.float8_e4m3fn) == 592 and fmt.row_width(576, torch.bfloat16) == 576
    assert fmt.value_width(torch.empty(2, 4, 592, dtype=torch.float8_e4m3fn)) == 576
    with pytest.raises(ValueError, match="multiple of 16 values, got 24"):
        fmt.row_width(24, torch.float8_e4m3fn)
    assert fmt.value_width(torch.empty(2, 4, 576)) == 576
    assert fmt.cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert fmt.cache_dtype("fp8", torch.bfloat16) == fmt.cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        fmt.cache_dtype("fp8_e5m2", torch.bfloat16)


def test_the_cli_offers_the_same_names():
    from deepinfer.cli.run import KV_CACHE_DTYPES

    assert KV_CACHE_DTYPES == fmt.KV_CACHE_DTYPES
