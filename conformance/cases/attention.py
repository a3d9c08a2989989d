"""Cases for kv_cache_write, mla_decode and prefill.

MLA shapes are DeepSeek-V3's latent cache (kv_lora_rank 512 + rope 64) in pages of 64 (CUDA) or
128 (Ascend) tokens, except in the cases named c96_r32, whose point is not the width: a narrow latent
(not a power of two, so the kernels' tiles have masked columns; the embedded tiny models' is 64)
keeps their caches small. V3's width stays in the one-token decode, the window (two query tokens),
the FP8 cache's decodes and the writes in pages of 64, so a GPU run still builds every kernel at the
model's size.
Every cache is filled with random values everywhere, so a kernel that reads a wrong page, a row past
seq_len, or overwrites a row it should skip, gets a different answer.
"""

from __future__ import annotations

from functools import partial

import torch

from deepinfer_conformance.cases import Case, randn

DTYPES = (torch.float32, torch.bfloat16)
LATENT, ROPE = 512, 64  # kv_lora_rank, qk_rope_head_dim
SOFTMAX_SCALE = (128 + 64) ** -0.5  # (qk_nope + qk_rope)^-0.5, as DeepSeek-V3 without YaRN


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def kv_cache_write_inputs(gen, dtype, *, slots: list[int], block_size: int, num_blocks: int, latent: int = LATENT, rope: int = ROPE):
    tokens = len(slots)
    return {
        "kv_c": randn(gen, tokens, latent, dtype=dtype),
        "k_pe": randn(gen, tokens, rope, dtype=dtype),
        "kv_cache": randn(gen, num_blocks, block_size, latent + rope, dtype=dtype),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
    }


def mla_decode_inputs(
    gen,
    dtype,
    *,
    seq_lens: list[int],
    num_queries: int,
    heads: int = 16,
    block_size: int = 64,
    spare_blocks: int = 1,
    shuffled: bool = False,
    sliding_window: int | None = None,
    latent: int = LATENT,
    rope: int = ROPE,
):
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + spare_blocks  # spare pages hold values no request may read
    order = torch.randperm(num_blocks, generator=gen) if shuffled else torch.arange(num_blocks)
    block_table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)  # padding: page 0
    start = 0
    for b, count in enumerate(pages):
        block_table[b, :count] = order[start : start + count]
        start += count
    batch = len(seq_lens)
    return {
        "q_nope": randn(gen, batch, num_queries, heads, latent, dtype=dtype),
        "q_rope": randn(gen, batch, num_queries, heads, rope, dtype=dtype),
        "kv_cache": randn(gen, num_blocks, block_size, latent + rope, dtype=dtype),
        "block_table": block_table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "softmax_scale": SOFTMAX_SCALE,
        "sliding_window": sliding_window,
    }


def prefill_inputs(gen, dtype, *, q_lens: list[int], k_lens: list[int], heads: int, qk_dim: int, v_dim: int, sliding_window: int | None = None):
    return {
        "q": randn(gen, sum(q_lens), heads, qk_dim, dtype=dtype),
        "k": randn(gen, sum(k_lens), heads, qk_dim, dtype=dtype),
        "v": randn(gen, sum(k_lens), heads, v_dim, dtype=dtype),
        "cu_seqlens_q": cu_seqlens(q_lens),
        "cu_seqlens_k": cu_seqlens(k_lens),
        "softmax_scale": qk_dim**-0.5,
        "sliding_window": sliding_window,
    }


RECIPES = [
    # Slots across a page boundary, out of order, with a padding slot (-1) that must write nothing, and the cache's
    # last slot.
    ("kv_cache_write", "bs64_across_blocks_skip", partial(kv_cache_write_inputs, slots=[62, 63, 64, 65, -1, 127], block_size=64, num_blocks=2)),
    ("kv_cache_write", "bs128_c96_r32_across_blocks_skip",
     partial(kv_cache_write_inputs, slots=[200, 127, -1, 128, 5, 255], block_size=128, num_blocks=2, latent=96, rope=32)),
    ("mla_decode", "b1_s1_h16_len1", partial(mla_decode_inputs, seq_lens=[1], num_queries=1)),
    ("mla_decode", "b2_s1_h16_c96_r32_len64_len65", partial(mla_decode_inputs, seq_lens=[64, 65], num_queries=1, latent=96, rope=32)),
    ("mla_decode", "b2_s2_h16_c96_r32_mtp_len2_len130", partial(mla_decode_inputs, seq_lens=[2, 130], num_queries=2, latent=96, rope=32)),
    ("mla_decode", "b4_s1_h16_c96_r32_mixed_shuffled_pages",
     partial(mla_decode_inputs, seq_lens=[1, 63, 129, 20], num_queries=1, spare_blocks=2, shuffled=True, latent=96, rope=32)),
    ("prefill", "b1_q1_k1_h4_d64", partial(prefill_inputs, q_lens=[1], k_lens=[1], heads=4, qk_dim=64, v_dim=64)),
    ("prefill", "b3_cached_prefix_h1_dqk192_dv128", partial(prefill_inputs, q_lens=[5, 1, 33], k_lens=[5, 40, 70], heads=1, qk_dim=192, v_dim=128)),
    ("prefill", "b2_q64_q65_h1_dqk192_dv128", partial(prefill_inputs, q_lens=[64, 65], k_lens=[64, 65], heads=1, qk_dim=192, v_dim=128)),
    ("prefill", "b2_window32_h2_dqk192_dv128", partial(prefill_inputs, q_lens=[40, 3], k_lens=[40, 70], heads=2, qk_dim=192, v_dim=128, sliding_window=32)),
]

# bf16 only: the window's masking is the same arithmetic in both dtypes, and the set's size budget is spent; the
# 64-head case is the width the cuda backend's Gluon kernel serves (at least 64 query rows, a bf16 cache): two
# queries of 64 heads are its two 64-row tiles, each with its own causal end.
BF16_RECIPES = [
    # The window skips page 0, masks part of page 1 and crosses into page 2.
    ("mla_decode", "b1_s2_h16_window48_len150", partial(mla_decode_inputs, seq_lens=[150], num_queries=2, sliding_window=48, spare_blocks=0)),
    ("mla_decode", "b1_s2_h64_len97_two_row_tiles", partial(mla_decode_inputs, seq_lens=[97], num_queries=2, heads=64, spare_blocks=0)),
]

CASES = [Case(op, name, dtype, make) for op, name, make in RECIPES for dtype in DTYPES] + [
    Case(op, name, torch.bfloat16, make) for op, name, make in BF16_RECIPES
]
