"""The attention references against independent float64 computations.

The independent side is written differently on purpose: per request, per query and per head, a
Python loop lists the visible key positions explicitly, gathers each cached token through its page
by hand, and takes a max-subtracted softmax with math.exp.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.ops import kv_cache_format
from deepinfer.ops.attention import kv_cache_write, mla_decode, prefill
from deepinfer.registry import all_ops

F64 = torch.float64


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = F64, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=F64) * scale).to(dtype)


def visible_positions(position: int, sliding_window: int | None) -> list[int]:
    first = 0 if sliding_window is None else max(0, position - sliding_window + 1)
    return list(range(first, position + 1))


def loop_attention(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """softmax(query . key * scale) weighted sum of values, one key at a time, in float64."""
    scores = [float(torch.dot(query.to(F64), key.to(F64))) * scale for key in keys]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    out = torch.zeros(values[0].shape, dtype=F64)
    for w, value in zip(weights, values):
        out += (w / total) * value.to(F64)
    return out


def cache_row(kv_cache: torch.Tensor, block_table: torch.Tensor, b: int, token: int) -> torch.Tensor:
    block_size = kv_cache.shape[1]
    return kv_cache[int(block_table[b, token // block_size]), token % block_size]


def loop_mla_decode(q_nope, q_rope, kv_cache, block_table, seq_lens, scale, sliding_window=None) -> torch.Tensor:
    batch, num_queries, heads, latent_dim = q_nope.shape
    out = torch.zeros(batch, num_queries, heads, latent_dim, dtype=F64)
    for b in range(batch):
        for s in range(num_queries):
            position = int(seq_lens[b]) - num_queries + s
            rows = [cache_row(kv_cache, block_table, b, j) for j in visible_positions(position, sliding_window)]
            for h in range(heads):
                query = torch.cat((q_nope[b, s, h], q_rope[b, s, h]))
                out[b, s, h] = loop_attention(query, rows, [row[:latent_dim] for row in rows], scale)
    return out


def loop_prefill(q, k, v, q_lens, k_lens, scale, sliding_window=None) -> torch.Tensor:
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=F64)
    q_start = k_start = 0
    for q_len, k_len in zip(q_lens, k_lens):
        for i in range(q_len):
            keys = [k_start + j for j in visible_positions(k_len - q_len + i, sliding_window)]
            for h in range(q.shape[1]):
                out[q_start + i, h] = loop_attention(q[q_start + i, h], [k[j, h] for j in keys], [v[j, h] for j in keys], scale)
        q_start, k_start = q_start + q_len, k_start + k_len
    return out


def paged_cache(gen, seq_lens, *, block_size, width, spare_blocks=2, dtype=F64):
    """A random cache whose pages are handed to requests in a shuffled order (padding entries: page 0)."""
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    for b, count in enumerate(pages):
        block_table[b, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    cache = rand(gen, num_blocks, block_size, width, dtype=dtype)
    return cache, block_table, torch.tensor(seq_lens, dtype=torch.int32)


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=torch.int32)


# ---------------------------------------------------------------------------------------------- kv_cache_write


@pytest.mark.parametrize("block_size", [64, 128])
def test_kv_cache_write_places_each_token_and_skips_negative_slots(block_size):
    gen = torch.Generator().manual_seed(0)
    slots = [block_size - 2, block_size - 1, -1, block_size, 2 * block_size + 5, 3]
    kv_c, k_pe = rand(gen, len(slots), 12), rand(gen, len(slots), 4)
    cache = rand(gen, 3, block_size, 16)
    before = cache.clone()

    result = kv_cache_write(kv_c, k_pe, cache, torch.tensor(slots))

    assert result is cache
    expected = before.clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected[slot // block_size, slot % block_size] = torch.cat((kv_c[t], k_pe[t]))
    assert torch.equal(cache, expected)
    written = {s for s in slots if s >= 0}
    untouched = [s for s in range(3 * block_size) if s not in written]
    flat_before, flat_after = before.flatten(0, 1), cache.flatten(0, 1)
    assert torch.equal(flat_after[untouched], flat_before[untouched])


def test_kv_cache_write_casts_to_the_cache_dtype():
    gen = torch.Generator().manual_seed(1)
    kv_c, k_pe = rand(gen, 3, 8, dtype=torch.float32), rand(gen, 3, 8, dtype=torch.float32)
    cache = torch.zeros(2, 4, 16, dtype=torch.bfloat16)
    kv_cache_write(kv_c, k_pe, cache, torch.tensor([7, 0, -5]))
    assert cache.dtype == torch.bfloat16
    assert torch.equal(cache[1, 3], torch.cat((kv_c[0], k_pe[0])).to(torch.bfloat16))
    assert torch.equal(cache[0, 0], torch.cat((kv_c[1], k_pe[1])).to(torch.bfloat16))
    assert int((cache != 0).any(-1).sum()) == 2


def test_kv_cache_write_compares_an_fp8_cache_by_its_values_and_any_other_as_it_is():
    """The canonical form the golden set stores: an FP8 cache dequantised (float32), a bfloat16 cache
    in bfloat16 (a float32 copy of it would double its golden's bytes for nothing)."""
    spec = all_ops()["kv_cache_write"]
    gen = torch.Generator().manual_seed(2)
    cache = rand(gen, 2, 4, 16, dtype=torch.bfloat16)
    assert spec.canonicalize({}, {"kv_cache": cache})["kv_cache"] is cache
    fp8 = kv_cache_format.quantize_rows(cache)
    values = spec.canonicalize({}, {"kv_cache": fp8})["kv_cache"]
    assert values.dtype == torch.float32 and torch.equal(values, kv_cache_format.dequantize_rows(fp8))


def test_kv_cache_write_rejects_bad_input():
    cache = torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match="past the cache"):
        kv_cache_write(torch.ones(1, 12), torch.ones(1, 4), cache, torch.tensor([8]))
    with pytest.raises(ValueError, match="widths"):
        kv_cache_write(torch.ones(1, 12), torch.ones(1, 3), cache, torch.tensor([0]))


# ---------------------------------------------------------------------------------------------- mla_decode


@pytest.mark.parametrize(
    "seq_lens, num_queries, block_size, sliding_window",
    [
        ([1, 16, 17, 40], 1, 16, None),  # length 1, at and across a page boundary
        ([2, 33, 20], 2, 16, None),  # MTP: two new tokens, one request holds nothing else
        ([3, 45, 16], 3, 8, 5),  # window crossing pages, shorter than some requests
        ([30], 2, 8, 100),  # window longer than the sequence
    ],
)
def test_mla_decode_matches_per_query_loop(seq_lens, num_queries, block_size, sliding_window):
    gen = torch.Generator().manual_seed(2)
    latent_dim, rope_dim, heads = 12, 4, 3
    cache, block_table, lens = paged_cache(gen, seq_lens, block_size=block_size, width=latent_dim + rope_dim)
    q_nope = rand(gen, len(seq_lens), num_queries, heads, latent_dim)
    q_rope = rand(gen, len(seq_lens), num_queries, heads, rope_dim)

    out = mla_decode(q_nope, q_rope, cache, block_table, lens, softmax_scale=0.3, sliding_window=sliding_window)

    expected = loop_mla_decode(q_nope, q_rope, cache, block_table, lens, 0.3, sliding_window)
    assert out.dtype == F64 and out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_mla_decode_absorbed_equals_naive_mla():
    """W_UV(absorbed output) equals attention with keys W_UK c_j (+ rope) and values W_UV c_j."""
    gen = torch.Generator().manual_seed(3)
    heads, latent_dim, nope_dim, v_dim, rope_dim, block_size = 4, 32, 16, 8, 8, 8
    seq_lens, num_queries, scale = [5, 19], 2, (nope_dim + rope_dim) ** -0.5
    w_uk, w_uv = rand(gen, heads, nope_dim, latent_dim), rand(gen, heads, v_dim, latent_dim)
    cache, block_table, lens = paged_cache(gen, seq_lens, block_size=block_size, width=latent_dim + rope_dim)
    q_nope_naive = rand(gen, len(seq_lens), num_queries, heads, nope_dim)
    q_rope = rand(gen, len(seq_lens), num_queries, heads, rope_dim)

    q_absorbed = torch.einsum("bshn,hnc->bshc", q_nope_naive, w_uk)
    out = torch.einsum("bshc,hvc->bshv", mla_decode(q_absorbed, q_rope, cache, block_table, lens, softmax_scale=scale), w_uv)

    naive = torch.zeros_like(out)
    for b, seq_len in enumerate(seq_lens):
        rows = [cache_row(cache, block_table, b, j) for j in range(seq_len)]
        latents, rope_keys = torch.stack([r[:latent_dim] for r in rows]), torch.stack([r[latent_dim:] for r in rows])
        for h in range(heads):
            k_nope = latents @ w_uk[h].T  # [N, nope]: the decompressed no-position keys
            values = latents @ w_uv[h].T  # [N, v]
            for s in range(num_queries):
                visible = range(seq_len - num_queries + s + 1)
                query = torch.cat((q_nope_naive[b, s, h], q_rope[b, s, h]))
                keys = [torch.cat((k_nope[j], rope_keys[j])) for j in visible]
                naive[b, s, h] = loop_attention(query, keys, [values[j] for j in visible], scale)
    assert (out - naive).abs().max() < 1e-11


def test_mla_decode_ignores_rows_past_seq_len_and_unused_pages():
    gen = torch.Generator().manual_seed(4)
    cache, block_table, lens = paged_cache(gen, [3, 9], block_size=4, width=10, spare_blocks=3)
    q_nope, q_rope = rand(gen, 2, 1, 2, 8), rand(gen, 2, 1, 2, 2)
    out = mla_decode(q_nope, q_rope, cache, block_table, lens, softmax_scale=0.5)

    used = {(int(block_table[b, j // 4]), j % 4) for b, n in enumerate([3, 9]) for j in range(n)}
    scrambled = cache.clone()
    for page in range(cache.shape[0]):
        for row in range(4):
            if (page, row) not in used:
                scrambled[page, row] = 1e3
    assert torch.equal(mla_decode(q_nope, q_rope, scrambled, block_table, lens, softmax_scale=0.5), out)


def test_mla_decode_window_of_one_returns_own_latent():
    gen = torch.Generator().manual_seed(5)
    cache, block_table, lens = paged_cache(gen, [7, 12], block_size=4, width=10)
    out = mla_decode(rand(gen, 2, 3, 2, 8), rand(gen, 2, 3, 2, 2), cache, block_table, lens, softmax_scale=1.0, sliding_window=1)
    for b, seq_len in enumerate([7, 12]):
        for s in range(3):
            own = cache_row(cache, block_table, b, seq_len - 3 + s)[:8]
            assert torch.equal(out[b, s], own.expand(2, 8))


def test_mla_decode_float32_queries_over_bfloat16_cache():
    gen = torch.Generator().manual_seed(6)
    cache, block_table, lens = paged_cache(gen, [10, 21], block_size=8, width=20, dtype=torch.bfloat16)
    q_nope, q_rope = rand(gen, 2, 2, 4, 16, dtype=torch.float32), rand(gen, 2, 2, 4, 4, dtype=torch.float32)
    expected = loop_mla_decode(q_nope, q_rope, cache, block_table, lens, 0.2)

    out32 = mla_decode(q_nope, q_rope, cache, block_table, lens, softmax_scale=0.2)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.to(F64), expected, rtol=1e-5, atol=1e-5)

    # Golden generation calls the reference with float64 queries while the cache may stay bfloat16.
    out64 = mla_decode(q_nope.to(F64), q_rope.to(F64), cache, block_table, lens, softmax_scale=0.2)
    assert out64.dtype == F64
    torch.testing.assert_close(out64, expected, rtol=0, atol=1e-12)


def test_mla_decode_equals_prefill_over_the_gathered_cache():
    """Decode is prefill with one shared key [c_j, k_j] and value c_j per token (MQA)."""
    gen = torch.Generator().manual_seed(7)
    seq_lens, num_queries, heads, latent_dim = [4, 13], 2, 3, 6
    cache, block_table, lens = paged_cache(gen, seq_lens, block_size=4, width=latent_dim + 2)
    q_nope, q_rope = rand(gen, 2, num_queries, heads, latent_dim), rand(gen, 2, num_queries, heads, 2)
    out = mla_decode(q_nope, q_rope, cache, block_table, lens, softmax_scale=0.4)

    rows = torch.stack([cache_row(cache, block_table, b, j) for b, n in enumerate(seq_lens) for j in range(n)])
    keys = rows[:, None, :].expand(-1, heads, -1)
    q = torch.cat((q_nope, q_rope), dim=-1).flatten(0, 1)
    via_prefill = prefill(q, keys, keys[..., :latent_dim], cu([num_queries] * 2), cu(seq_lens), softmax_scale=0.4)
    torch.testing.assert_close(out.flatten(0, 1), via_prefill, rtol=0, atol=1e-12)


def test_mla_decode_rejects_seq_len_shorter_than_new_tokens():
    cache, block_table = torch.zeros(2, 4, 10), torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="new tokens"):
        mla_decode(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 2), cache, block_table, torch.tensor([1], dtype=torch.int32), softmax_scale=1.0)
    with pytest.raises(ValueError, match="pages"):
        mla_decode(torch.ones(1, 1, 1, 8), torch.ones(1, 1, 1, 2), cache, block_table, torch.tensor([9], dtype=torch.int32), softmax_scale=1.0)


# ---------------------------------------------------------------------------------------------- prefill


@pytest.mark.parametrize(
    "q_lens, k_lens, sliding_window",
    [
        ([1], [1], None),
        ([3, 1, 6, 0], [3, 9, 11, 2], None),  # no prefix, decode-like, cached prefix, no queries
        ([5, 2], [12, 2], 4),
        ([4], [7], 50),
    ],
)
def test_prefill_matches_per_query_loop(q_lens, k_lens, sliding_window):
    gen = torch.Generator().manual_seed(8)
    heads, qk_dim, v_dim = 2, 6, 4  # Dqk != Dv, as DeepSeek's 192 / 128
    q, k, v = rand(gen, sum(q_lens), heads, qk_dim), rand(gen, sum(k_lens), heads, qk_dim), rand(gen, sum(k_lens), heads, v_dim)

    out = prefill(q, k, v, cu(q_lens), cu(k_lens), softmax_scale=0.7, sliding_window=sliding_window)

    assert out.dtype == F64 and out.shape == (sum(q_lens), heads, v_dim)
    torch.testing.assert_close(out, loop_prefill(q, k, v, q_lens, k_lens, 0.7, sliding_window), rtol=0, atol=1e-12)


def test_prefill_with_cached_prefix_equals_last_rows_of_full_causal_attention():
    gen = torch.Generator().manual_seed(9)
    length, new, heads, scale = 37, 6, 3, 0.25
    q, k, v = rand(gen, length, heads, 10), rand(gen, length, heads, 10), rand(gen, length, heads, 7)
    full = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    ).transpose(0, 1)

    out = prefill(q[-new:], k, v, cu([new]), cu([length]), softmax_scale=scale)

    torch.testing.assert_close(out, full[-new:], rtol=0, atol=1e-12)


def test_prefill_sliding_window_limits_and_covers():
    gen = torch.Generator().manual_seed(10)
    q, k, v = rand(gen, 5, 2, 4), rand(gen, 9, 2, 4), rand(gen, 9, 2, 3)
    own = prefill(q, k, v, cu([5]), cu([9]), softmax_scale=1.0, sliding_window=1)
    assert torch.equal(own, v[4:])  # each query sees only its own key
    unbounded = prefill(q, k, v, cu([5]), cu([9]), softmax_scale=1.0)
    assert torch.equal(prefill(q, k, v, cu([5]), cu([9]), softmax_scale=1.0, sliding_window=9), unbounded)
    assert not torch.allclose(prefill(q, k, v, cu([5]), cu([9]), softmax_scale=1.0, sliding_window=8), unbounded)


def test_prefill_bfloat16_accumulates_in_float32():
    gen = torch.Generator().manual_seed(11)
    q, k, v = (rand(gen, 20, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    out = prefill(q, k, v, cu([20]), cu([20]), softmax_scale=0.25)
    assert out.dtype == torch.bfloat16
    expected = loop_prefill(q, k, v, [20], [20], 0.25)
    torch.testing.assert_close(out.to(F64), expected, rtol=8e-3, atol=8e-3)  # only the final rounding to bf16


def test_prefill_rejects_more_queries_than_keys_and_bad_offsets():
    x = torch.ones(4, 1, 8)
    with pytest.raises(ValueError, match="q_len <= k_len"):
        prefill(x, x[:3], x[:3], cu([4]), cu([3]), softmax_scale=1.0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        prefill(x, x, x, cu([3]), cu([4]), softmax_scale=1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        prefill(x, x, x, cu([4]), cu([4]), softmax_scale=1.0, sliding_window=0)
