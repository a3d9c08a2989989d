"""Cases for the FP8 KV cache (`kv_cache_dtype="fp8"`): every op that writes or reads cache rows.

The cache rows are e4m3 values with the token's float32 scale in 4 trailing bytes
(deepinfer.ops.kv_cache_format); caches are filled everywhere with properly quantised random rows,
so a kernel that reads a wrong row, ignores the scale or reads the scale bytes as values gets a
different answer. The recipes are the bf16 cases' (attention.py, v4.py) with FP8 caches, plus rows
the quantiser must take care over: all zeros (the amax floor), values up to 1e4, and values around
e4m3's subnormals. Two keep the model's width where their plain twin is narrow (mla_decode's two
requests of 64 and 65 tokens, sparse_attention's CSA case), so that an FP8 cache is read at V3's and
V4's row widths by one- and two-token decodes and by both lists.
"""

from __future__ import annotations

from functools import partial

import torch

from deepinfer.ops import kv_cache_format
from deepinfer_conformance.cases import Case, drawn_as
from deepinfer_conformance.cases.attention import kv_cache_write_inputs, mla_decode_inputs
from deepinfer_conformance.cases.v4 import indexer_topk_inputs, norm_rope_write_inputs, sparse_attention_inputs, with_output_rotation

DTYPES = (torch.float32, torch.bfloat16)


def fp8_cache(cache: torch.Tensor) -> torch.Tensor:
    """A cache of the same rows in the FP8 format."""
    return kv_cache_format.quantize_rows(cache)


def with_fp8(make, *names: str):
    """The inputs `make` builds, with the tensors `names` turned into FP8 caches."""

    def fp8_inputs(gen, dtype):
        kw = make(gen, dtype)
        for name in names:
            kw[name] = fp8_cache(kw[name])
        return kw

    return fp8_inputs


def hard_rows_write(gen, dtype, **layout):
    """kv_cache_write of tokens whose rows stress the quantiser: zeros, large, tiny, mixed magnitudes."""
    kw = kv_cache_write_inputs(gen, dtype, **layout)
    kv_c, k_pe = kw["kv_c"].double(), kw["k_pe"].double()
    kv_c[0], k_pe[0] = 0.0, 0.0  # all zeros: the amax floor keeps the scale finite
    kv_c[1] *= 1e4  # large values
    kv_c[2] *= 1e-3  # small values: the per-row scale keeps them normal
    k_pe[2] *= 1e-6  # a tiny part beside larger ones: e4m3 subnormals and zeros
    kw["kv_c"], kw["k_pe"] = kv_c.to(dtype), k_pe.to(dtype)
    kw["kv_cache"] = fp8_cache(kw["kv_cache"])
    return kw


def exact_norm_rope_write(gen, dtype, *, dim: int, rope_dim: int, rows_per_block: int, pool_rows: list[int]):
    """norm_rope_kv_write into an FP8 pool, its values exact in float32: rows of +-2^k (k per row) with eps 0 norm to
    +-weight exactly, and a table of quarter turns (one of cos and sin 0, the other +-1) rotates them exactly. A value
    computed in float32 and in float64 may otherwise fall on two sides of an e4m3 rounding boundary (a step of up to
    1/8 of the value); here every backend quantises the same numbers and the comparison keeps its tolerance."""
    kw = norm_rope_write_inputs(gen, dtype, dim=dim, rope_dim=rope_dim, rows_per_block=rows_per_block, pool_rows=pool_rows)
    rows = len(pool_rows)
    signs = torch.randint(0, 2, (rows, dim), generator=gen) * 2 - 1
    kw["x"] = (signs * 2.0 ** torch.randint(-8, 9, (rows, 1), generator=gen)).to(kw["x"].dtype)
    kw["eps"] = 0.0
    turns = torch.randint(0, 4, (kw["cos_sin_cache"].shape[0], rope_dim // 2), generator=gen)
    cos, sin = torch.tensor([1.0, 0.0, -1.0, 0.0])[turns], torch.tensor([0.0, 1.0, 0.0, -1.0])[turns]
    kw["cos_sin_cache"] = torch.cat((cos, sin), dim=-1)
    kw["kv_cache"] = fp8_cache(kw["kv_cache"])
    return kw


RECIPES = [
    ("kv_cache_write", "fp8_bs64_across_blocks_skip",
     with_fp8(partial(kv_cache_write_inputs, slots=[62, 63, 64, 65, -1, 127], block_size=64, num_blocks=2), "kv_cache")),
    ("kv_cache_write", "fp8_bs128_c96_r32_zero_large_tiny_rows",
     partial(hard_rows_write, slots=[200, 127, 5, -1, 128], block_size=128, num_blocks=2, latent=96, rope=32)),
    ("mla_decode", "fp8_b2_s1_h16_len64_len65", with_fp8(partial(mla_decode_inputs, seq_lens=[64, 65], num_queries=1), "kv_cache")),
    ("mla_decode", "fp8_b1_s2_h16_window48_len150", with_fp8(partial(mla_decode_inputs, seq_lens=[150], num_queries=2, sliding_window=48), "kv_cache")),
    ("mla_decode", "fp8_b4_s1_h16_c96_r32_mixed_shuffled_pages",
     with_fp8(partial(mla_decode_inputs, seq_lens=[1, 63, 129, 20], num_queries=1, spare_blocks=2, shuffled=True, latent=96, rope=32), "kv_cache")),
    ("sparse_attention", "fp8_decode_t1_h16_d512_window128", with_fp8(partial(sparse_attention_inputs, seqs=[(190, 1)], heads=16), "kv")),
    ("sparse_attention", "fp8_csa_t6_h8_d512_top32_shuffled_padding",
     with_fp8(partial(sparse_attention_inputs, seqs=[(40, 2), (140, 3), (3, 1)], heads=8, extra="csa", ratio=4, topk=32), "kv", "extra_kv")),
    ("sparse_attention", "fp8_hca_t4_h16_d128_all_visible_entries",
     with_fp8(partial(sparse_attention_inputs, seqs=[(260, 2), (390, 1)], heads=16, dim=128, extra="hca", ratio=128), "kv", "extra_kv")),
    ("norm_rope_kv_write", "fp8_d512_r64_exact_values_skipped",
     partial(exact_norm_rope_write, dim=512, rope_dim=64, rows_per_block=16, pool_rows=[3, -1, 20, 17])),
    ("indexer_topk", "fp8_decode_t1_h64_d128_e100_top32", partial(indexer_topk_inputs, seqs=[(400, 1)], top_k=32, fp8_keys=True)),
    ("indexer_topk", "fp8_prefill_b3_h16_d128_top16_mixed_visibility",
     partial(indexer_topk_inputs, seqs=[(0, 6), (60, 3), (90, 4)], top_k=16, heads=16, fp8_keys=True)),
]  # fmt: skip

# In bfloat16 only (V4 runs an FP8 cache beside bf16 activations; the golden set's budget): the output rotated back
# (out_positions) over the inputs of the HCA case above (stored once), rope channels in two of the column parts an
# FP8 cache's accumulator is kept in on ascend.
BF16_RECIPES = [
    ("sparse_attention", "fp8_hca_t4_h16_d128_out_rotated_r64",
     drawn_as("sparse_attention.fp8_hca_t4_h16_d128_all_visible_entries", with_output_rotation(
         with_fp8(partial(sparse_attention_inputs, seqs=[(260, 2), (390, 1)], heads=16, dim=128, extra="hca", ratio=128), "kv", "extra_kv"), 64))),
]  # fmt: skip

CASES = [Case(op, name, dtype, make) for op, name, make in RECIPES for dtype in DTYPES] + [
    Case(op, name, torch.bfloat16, make) for op, name, make in BF16_RECIPES
]
