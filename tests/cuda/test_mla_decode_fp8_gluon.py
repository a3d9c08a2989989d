"""The SM90 Gluon mla_decode over an FP8 cache: on a CPU, which models it is chosen for, which calls it serves, its
split plan and the exactness of its raw-bf16 conversion; on an SM90 GPU (TRITON_INTERPRET=0 pytest
tests/cuda/test_mla_decode_fp8_gluon.py), its output against the tl kernel's on the shapes the golden set has no
room for (splits and their combine, S > 1, 128 heads as two row tiles, ragged lengths). Its compilation for sm90 is
tests/cuda/test_compile_check.py's; its golden cases are `deepinfer conformance --backend cuda`'s."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import deepinfer_cuda.kernels.mla_decode_fp8_gluon as g  # (imports without Gluon too: GLUON_IMPORT_ERROR says why, below)
from deepinfer.ops import kv_cache_format
from deepinfer.registry import ModelFacts, ResolveContext

from triton_mode import GPU, mode

if g.GLUON_IMPORT_ERROR is not None:
    pytest.skip(f"no Gluon for Hopper in this Triton (runs with Triton >= 3.5: CI, the GPU machine): {g.GLUON_IMPORT_ERROR}", allow_module_level=True)

FACTS = ModelFacts(kv_cache_fp8=True, kv_lora_rank=512, qk_rope_head_dim=64, sliding_window=0, kv_block_size=64, num_heads=16)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _fp8_cache_meta(pages: int):
    return torch.empty(pages, 64, 592, dtype=torch.float8_e4m3fn, device="meta")


def test_chosen_for_sm90_models_with_an_fp8_cache_of_its_rows_only(monkeypatch):
    import deepinfer_cuda.kernels.gemm_mxfp4_gluon as gemm_gluon

    ctx = ResolveContext(backend="cuda", device=torch.device("cuda", 0), model=FACTS)
    monkeypatch.setattr(gemm_gluon, "is_sm90", lambda device: False)
    assert not g._chosen(ctx)
    monkeypatch.setattr(gemm_gluon, "is_sm90", lambda device: True)
    assert g._chosen(ctx)
    for other in (dict(kv_cache_fp8=False), dict(kv_cache_fp8=None), dict(kv_lora_rank=96), dict(qk_rope_head_dim=32),
                  dict(sliding_window=128), dict(sliding_window=None), dict(kv_block_size=128)):  # fmt: skip
        assert not g._chosen(dataclasses.replace(ctx, model=dataclasses.replace(FACTS, **other))), other


def test_calls_it_does_not_serve_say_why():
    cache = _fp8_cache_meta(8)
    q = lambda s, h, dtype=torch.bfloat16: (_meta(2, s, h, 512, dtype=dtype), _meta(2, s, h, 64, dtype=dtype))  # noqa: E731
    for s, h in ((1, 16), (4, 16), (1, 64), (1, 128), (2, 64)):
        assert g.not_served(*q(s, h), cache, None) is None, (s, h)
    assert "S*H = 96" in g.not_served(*q(1, 96), cache, None)
    assert "S*H = 256" in g.not_served(*q(2, 128), cache, None)
    assert "not FP8" in g.not_served(*q(1, 16), _meta(8, 64, 576), None)
    assert "sliding window" in g.not_served(*q(1, 16), cache, 128)
    assert "bfloat16" in g.not_served(*q(1, 16, torch.float16), cache, None)
    assert "deterministic" in g.not_served(*q(2, 16), cache, None, tiles_of_one_query=True)
    cpu = torch.zeros(1, 1, 16, 512, dtype=torch.bfloat16), torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16)
    assert "not on a GPU" in g.not_served(*cpu, torch.zeros(2, 64, 592, dtype=torch.float8_e4m3fn), None)


def test_the_plan_splits_whole_pages_as_the_tl_kernel_does(monkeypatch):
    import deepinfer_cuda.kernels.mla_decode_gluon_parts as parts

    monkeypatch.setattr(parts, "num_sms", lambda device: 132)
    one = g.plan(128, 16, 4096, torch.device("meta"))
    assert (one.row_tiles, one.num_splits, one.direct) == (1, 1, True)  # 128 requests fill the SMs
    few = g.plan(2, 128, 4096, torch.device("meta"))
    assert few.row_tiles == 2 and few.num_splits > 1 and few.tokens_per_split % 64 == 0
    assert few.tokens_per_split * few.num_splits >= 4096 > few.tokens_per_split * (few.num_splits - 1)
    forced = g.plan(4, 16, 4096, torch.device("meta"), num_splits=8)
    assert (forced.num_splits, forced.tokens_per_split) == (8, 512)


def test_a_tile_is_one_page_and_a_split_whole_tiles():
    """The converting warpgroup reads tile j of a split from block-table entry lo // PAGE + j: a tile is one page, and
    every split (planned or forced) starts on a page."""
    assert g.BLOCK_N == g.PAGE == g.SPLIT_GRANULE == 64
    for kw in (dict(), dict(num_splits=3), dict(tokens_per_split=100), dict(tokens_per_split=1)):
        assert g.plan(2, 16, 4000, torch.device("meta"), **kw).tokens_per_split % g.BLOCK_N == 0, kw


def test_the_raw_bf16_conversion_is_exact_for_every_e4m3_value():
    """The converter's bits: e4m3 -> half (exact), then the half's exponent and top 7 mantissa bits shifted right by 3
    under its sign: a normal bf16 of value * 2^-112 (RAW_UNIT brings it back), zero for zero."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    finite = ~torch.isnan(values)
    half = values.to(torch.float16).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    raw = torch.from_numpy((((half >> 3) & 0x0FFF) | (half & 0x8000)).astype(np.int16)).view(torch.bfloat16).float()
    assert g.RAW_UNIT_VALUE == 2.0**112
    assert torch.equal((raw * g.RAW_UNIT_VALUE)[finite], values[finite])
    assert raw[finite & (values != 0)].abs().min() >= torch.finfo(torch.bfloat16).tiny  # never subnormal
    assert "shr.b32 p, p, 3" in g.E4M3X4_TO_RAW_BF16X4_PTX and "and.b32 p, p, 0x0FFF0FFF" in g.E4M3X4_TO_RAW_BF16X4_PTX


@pytest.mark.skipif(mode() != GPU or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="runs on an SM90 GPU only (TRITON_INTERPRET=0 pytest tests/cuda/test_mla_decode_fp8_gluon.py)")
@pytest.mark.parametrize("batch, heads, ctx, queries, splits", [
    (4, 16, 4096, 1, None), (4, 16, 4096, 1, 1), (4, 16, 4096, 1, 8), (4, 128, 4096, 1, None), (4, 16, 4096, 4, 3), (2, 16, 960, 2, None),
])  # fmt: skip
def test_matches_the_tl_kernel_on_the_gpu(batch, heads, ctx, queries, splits):
    from deepinfer_cuda.kernels import mla_decode as tl_mla

    gen = torch.Generator(device="cuda").manual_seed(0)
    pages = batch * (ctx // 64)
    cache = kv_cache_format.quantize_rows(torch.randn(pages, 64, 576, device="cuda", generator=gen))
    block_table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(batch, ctx // 64)
    seq_lens = torch.randint(ctx // 2, ctx + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    q_nope = torch.randn(batch, queries, heads, 512, device="cuda", generator=gen).to(torch.bfloat16)
    q_rope = torch.randn(batch, queries, heads, 64, device="cuda", generator=gen).to(torch.bfloat16)
    want = tl_mla.launch_mla_decode(q_nope, q_rope, cache, block_table, seq_lens, 192**-0.5, num_splits=splits)
    got = g.launch_mla_decode_fp8_gluon(q_nope, q_rope, cache, block_table, seq_lens, 192**-0.5, num_splits=splits)
    assert got is not None and not got.isnan().any()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 1.6e-2 * max(1.0, want.float().abs().max().item()), err  # bf16 rounding of outputs ~1 (seen on an H100: <= 9.8e-4)
