"""Cases for DeepSeek-V4's ops: sparse_attention, compress_kv, norm_rope_kv_write, indexer_topk, hc_pre,
hc_head, hc_post and clamped_silu_and_mul.

Shapes are V4's where it is cheap (head_dim 512 with a 128-token sliding window, CSA ratio 4 with
overlapping windows, HCA ratio 128, the indexer's 64 heads of 128, 4 residual streams), cut to a few
tokens and, where a case's name says so, to narrower widths: the golden set holds the edges (tile
remainders, masks, splits), `deepinfer bench ops` the full sizes (V4-Flash's 4096-wide streams). Row
ids are laid out as deepinfer.model.deepseek_v4.step plans them (paged windows with -1 before
position 0, per-sequence entry tables with -1 past their last entry, compressor sources contiguous
per sequence), in pages of 16 rows (the kernels see row ids only) of which only those a window
reaches are allocated, and every cache is filled everywhere, so a kernel that reads a row nobody
listed gets a different answer.
"""

from __future__ import annotations

from functools import partial

import torch

from deepinfer.ops import kv_cache_format
from deepinfer.ops.rope import rope_cos_sin_cache
from deepinfer_conformance.cases import Case, drawn_as, randn

DTYPES = (torch.float32, torch.bfloat16)
HEAD_DIM = 512  # V4's attention head_dim: one shared key/value row per token
WINDOW = 128  # sliding_window
INDEX_HEADS, INDEX_DIM = 64, 128  # index_n_heads, index_head_dim
SWIGLU_LIMIT = 10.0


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ---------------------------------------------------------------------------------- sparse_attention


def paged_sequences(gen, seqs: list[tuple[int, int]], block_size: int, spare_blocks: int, window: int):
    """Random distinct pages per sequence (start, length) as a block table would give them, and the
    position of every query token. Pages before the first one a query's window reaches are never
    read, so they are not allocated (None): the cache holds the windows' pages and `spare_blocks`
    more. Returns (pages per sequence, [(seq, position)], number of blocks)."""
    first_page = [max(0, start - window + 1) // block_size for start, _ in seqs]
    pages_needed = [-(-(start + length) // block_size) - first for (start, length), first in zip(seqs, first_page)]
    num_blocks = sum(pages_needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    pages, tokens, taken = [], [], 0
    for b, ((start, length), first, count) in enumerate(zip(seqs, first_page, pages_needed)):
        pages.append([None] * first + order[taken : taken + count])
        taken += count
        tokens += [(b, p) for p in range(start, start + length)]
    return pages, tokens, num_blocks


def window_ids(pages: list[int], position: int, window: int, block_size: int) -> list[int]:
    """The sliding window's cache rows of a query at `position`, -1 before position 0 (step.py's layout)."""
    return [pages[q // block_size] * block_size + q % block_size if q >= 0 else -1 for q in range(position - window + 1, position + 1)]


def sparse_attention_inputs(
    gen,
    dtype,
    *,
    seqs: list[tuple[int, int]],
    heads: int,
    dim: int = HEAD_DIM,
    window: int = WINDOW,
    block_size: int = 16,
    extra: str | None = None,
    ratio: int = 4,
    topk: int = 32,
    sinks: list[float] | None = None,
    q_scale: float = 1.0,
    empty_queries: tuple[int, ...] = (),
    scatter_padding: float = 0.0,
    same_ids: bool = False,
    lengths: bool = False,
    extra_width: int | None = None,
):
    """Queries of the sequences `seqs` ((start, length) each) over their paged sliding windows, and,
    with `extra`, the compressed entries of a pool in the same softmax: "hca" every visible entry
    (-1 beyond), "csa" up to `topk` distinct visible entries in random order (an indexer's choice),
    -1 padded (to `extra_width` columns when given: a decode plan's E_max). `empty_queries` list no
    row at all; `scatter_padding` blanks that fraction of the listed ids anywhere in the rows;
    `same_ids` makes each query's extra ids the same numbers as its window ids (rows of the other
    cache). lengths: `extra_lengths` gives each query's count of listed entries, and the columns
    after it hold ids of real pool rows, which the op must not read. sinks: per head (default: randn)."""
    pages, tokens, num_blocks = paged_sequences(gen, seqs, block_size, spare_blocks=1, window=window)
    indices = int32([window_ids(pages[b], p, window, block_size) for b, p in tokens])
    kw = {
        "q": randn(gen, len(tokens), heads, dim, dtype=dtype, scale=q_scale),
        "kv": randn(gen, num_blocks * block_size, dim, dtype=dtype),
        "indices": indices,
        "sinks": torch.tensor(sinks, dtype=torch.float32) if sinks is not None else randn(gen, heads),
        "softmax_scale": dim**-0.5,
    }
    extra_ids = None
    if same_ids:
        kw["extra_kv"] = randn(gen, num_blocks * block_size, dim, dtype=dtype)
        extra_ids = torch.stack([row[torch.randperm(row.numel(), generator=gen)] for row in indices])
    elif extra is not None:
        entries = [(start + length) // ratio for start, length in seqs]  # complete windows per sequence
        pool = sum(entries) + 7  # spare rows no query may read
        rows = torch.randperm(pool, generator=gen).tolist()
        tables, taken = [], 0
        for n in entries:
            tables.append(rows[taken : taken + n])
            taken += n
        lists = []
        for b, p in tokens:
            visible = tables[b][: (p + 1) // ratio]
            if extra == "csa":
                pick = torch.randperm(len(visible), generator=gen)[:topk].tolist()
                visible = [visible[i] for i in pick]
            lists.append(visible)
        width = extra_width or (topk if extra == "csa" else max(entries))
        if lengths:  # past each length: rows that exist (read them and the answer changes)
            extra_ids = int32([ids + torch.randint(0, pool, (width - len(ids),), generator=gen).tolist() for ids in lists])
            kw["extra_lengths"] = int32([len(ids) for ids in lists])
        else:
            extra_ids = int32([ids + [-1] * (width - len(ids)) for ids in lists])
        kw["extra_kv"] = randn(gen, pool, dim, dtype=dtype)
    if extra_ids is not None:
        kw["extra_indices"] = extra_ids
    for name in ("indices", "extra_indices"):
        if name in kw:
            ids = kw[name]
            if scatter_padding:
                ids[torch.rand(ids.shape, generator=gen) < scatter_padding] = -1
            ids[list(empty_queries)] = -1
    return kw


def with_output_rotation(make, rope_dim: int, max_pos: int = 16):
    """`make`'s sparse_attention inputs and, drawn after them, out_positions and the inverse rope table V4
    passes (cos, -sin: the output's last rope_dim channels rotated back). The positions need not be the
    queries' (the op takes them as given), so the table stays a few rows."""

    def made(gen, dtype):
        kw = make(gen, dtype)
        table = rope_cos_sin_cache(rope_dim, max_pos, 10000.0)
        kw["out_positions"] = torch.randint(0, max_pos, (kw["q"].shape[0],), generator=gen, dtype=torch.int64)
        kw["out_cos_sin_cache"] = torch.cat((table[:, : rope_dim // 2], -table[:, rope_dim // 2 :]), dim=1)
        return kw

    return made


# --------------------------------------------------------------------------------------- compress_kv


def compress_kv_inputs(
    gen,
    dtype,
    *,
    ratio: int,
    overlap: bool,
    dim: int,
    seqs: list[tuple[int, int]],
    gate_scale: float = 1.0,
    bias_scale: float = 0.5,
    shuffle: bool = False,
):
    """The compressor's ordered sources (rows of projected kv / gate, each sequence's contiguous) and
    the windows closing this step. seqs: (first window, windows) per sequence; with overlap a
    sequence that does not start at window 0 also holds the previous window's tokens (its history),
    and each sequence ends with a few tokens of an open window (1 to 7) that no entry may read."""
    width = 2 * dim if overlap else dim
    starts, prevs, rows = [], [], 0
    for first, count in seqs:
        lead = ratio if overlap and first > 0 else 0
        base = rows + lead
        for i in range(count):
            starts.append(base + i * ratio)
            prevs.append(base + (i - 1) * ratio if overlap and first + i > 0 else -1)
        rows = base + count * ratio + int(torch.randint(1, min(ratio, 8), (1,), generator=gen))  # the open window's tokens
    order = torch.randperm(len(starts), generator=gen) if shuffle else torch.arange(len(starts))
    return {
        "kv": randn(gen, rows, width, dtype=dtype),
        "gate": randn(gen, rows, width, dtype=dtype, scale=gate_scale),
        "position_bias": randn(gen, ratio, width, scale=bias_scale),
        "window_starts": torch.tensor(starts, dtype=torch.int64)[order],
        "prev_starts": torch.tensor(prevs, dtype=torch.int64)[order],
        "ratio": ratio,
        "overlap": overlap,
    }


def compress_kv_ring_inputs(gen, dtype, *, ratio: int, overlap: bool, dim: int, ring: int, positions: list[int | None]):
    """A decode step over the flat compressor ring ([slots x ring] rows, row slot * ring + position % ring, every
    row filled): one entry per sequence, the one whose window closes at its token's position p ((p + 1) % ratio
    == 0), window start -1 (skipped) for the others and for padding (None); skipped entries carry a stale prev."""
    width = 2 * dim if overlap else dim
    starts, prevs = [], []
    for slot, p in enumerate(positions):
        base, window = slot * ring, (p + 1) // ratio - 1 if p is not None else -1
        if p is None or (p + 1) % ratio:
            starts.append(-1)
            prevs.append(int(torch.randint(0, len(positions) * ring - ratio, (1,), generator=gen)) if overlap else -1)
            continue
        starts.append(base + window * ratio % ring)
        prevs.append(base + (window - 1) * ratio % ring if overlap and window > 0 else -1)
    rows = len(positions) * ring
    return {
        "kv": randn(gen, rows, width, dtype=dtype),
        "gate": randn(gen, rows, width, dtype=dtype),
        "position_bias": randn(gen, ratio, width, scale=0.5),
        "window_starts": torch.tensor(starts, dtype=torch.int64),
        "prev_starts": torch.tensor(prevs, dtype=torch.int64),
        "ratio": ratio,
        "overlap": overlap,
    }


def ring_write_inputs(gen, dtype, *, slots: int, ring: int, width: int, rows: list[int]):
    """kv_cache_write as a V4 decode step writes its tokens' compressor projections into the ring: rows in the
    model (case) dtype, as the projection GEMM gives them, of `width` channels and no rope part, into the float32
    ring (whatever the model dtype: the ring is float32 state) viewed as pages of `ring` rows, one per state slot;
    row -1 (padding) writes nothing."""
    return {
        "kv_c": randn(gen, len(rows), width, dtype=dtype),
        "k_pe": torch.empty(len(rows), 0),
        "kv_cache": randn(gen, slots, ring, width),
        "slot_mapping": torch.tensor(rows, dtype=torch.int64),
    }


# -------------------------------------------------------------------------------- norm_rope_kv_write


def norm_rope_write_inputs(gen, dtype, *, dim: int, rope_dim: int, rows_per_block: int, pool_rows: list[int], x_dtype=torch.float32,
                           x_scale: float = 1.0, max_position: int = 96):  # fmt: skip
    """A compressor's emission: entries (float32, as compress_kv gives them, unless `x_dtype` is None: the case
    dtype) normed, their last rope_dim channels rotated at their windows' first positions and written to pool
    rows (flat, pages of rows_per_block rows), -1: skipped, with a position past the table there (never read).
    The pool, in the case dtype, is filled everywhere; the table is random (not a rotation: a swapped cos and
    sin, or a pair rotated the wrong way, changes the answer)."""
    num_blocks = max(pool_rows) // rows_per_block + 1  # the last row's block: its other rows stay as they were
    positions = torch.randint(0, max_position, (len(pool_rows),), generator=gen)
    return {
        "x": randn(gen, len(pool_rows), dim, dtype=x_dtype or dtype, scale=x_scale),
        "weight": 1 + randn(gen, dim, scale=0.3),
        "positions": torch.where(torch.tensor(pool_rows) >= 0, positions, max_position + 7),
        "cos_sin_cache": randn(gen, max_position, rope_dim),
        "kv_cache": randn(gen, num_blocks, rows_per_block, dim, dtype=dtype),
        "slot_mapping": torch.tensor(pool_rows, dtype=torch.int64),
        "eps": 1e-6,
    }


# -------------------------------------------------------------------------------------- indexer_topk


def head_norm_rope_inputs(gen, dtype, *, tokens: int, heads: int, dim: int, normed: bool, x_scale: float = 1.0):
    """Query heads (x_scale: as large as wq_b's outputs get) at positions spread over a 32-row table of rope
    dim 64, or of every channel for narrower heads (equal tables are stored once)."""
    return {
        "x": randn(gen, tokens, heads, dim, dtype=dtype, scale=x_scale),
        "positions": torch.randint(0, 32, (tokens,), generator=gen, dtype=torch.int64),
        "cos_sin_cache": rope_cos_sin_cache(min(64, dim), 32, 10000.0),
        "eps": 1e-6 if normed else None,
    }


def indexer_topk_inputs(
    gen,
    dtype,
    *,
    seqs: list[tuple[int, int]],
    top_k: int,
    ratio: int = 4,
    heads: int = INDEX_HEADS,
    dim: int = INDEX_DIM,
    spare_rows: int = 9,
    zero_scores: float = 0.0,
    fp8_keys: bool = False,
    weights_dtype: torch.dtype | None = None,
    scale_sign: float = 1.0,
):
    """Indexer queries of the sequences `seqs` ((start, length) each) over their compressed keys:
    each sequence's entries at random distinct rows of one pool (its table -1 past its last entry),
    query t seeing the entries whose window is complete at its position. Weights carry the
    caller's scales (index_n_heads^-0.5 * index_head_dim^-0.5), of both signs as weights_proj gives.
    weights_dtype: the weights as the model passes them instead: weights_proj's output in that dtype,
    the scales in weights_scale (times scale_sign: -1 reverses the ranking, so a kernel that drops the
    scale fails).
    fp8_keys: the keys as an FP8 cache's rows (kv_cache_format), the top-k margin checked on their values.
    zero_scores: that fraction of the keys points away from every query head (relu: a score of
    exactly 0, equal scores that rank by lowest entry id), weights then positive."""
    entries = [(start + length) // ratio for start, length in seqs]
    width = max(entries)
    pool = sum(entries) + spare_rows
    rows = torch.randperm(pool, generator=gen).tolist()
    table, taken, token_seq, num_visible = [], 0, [], []
    for b, ((start, length), n) in enumerate(zip(seqs, entries)):
        table.append(rows[taken : taken + n] + [-1] * (width - n))
        taken += n
        for p in range(start, start + length):
            token_seq.append(b)
            num_visible.append((p + 1) // ratio)
    keys = randn(gen, pool, dim, dtype=torch.float64)
    if zero_scores:
        keys[:, 0] = torch.where(torch.rand(pool, generator=gen, dtype=torch.float64) < zero_scores, -8.0, 8.0)
    kw = {
        "index_keys": kv_cache_format.quantize_rows(keys) if fp8_keys else keys.to(dtype),
        "entry_rows": int32(table).view(len(seqs), width),
        "token_seq": int32(token_seq),
        "num_visible": int32(num_visible),
        "top_k": top_k,
    }
    scale = (heads**-0.5) * (dim**-0.5)
    if weights_dtype is not None:
        kw["weights_scale"] = scale_sign * scale
    for _ in range(100):  # queries whose top-k set a float32 kernel summing in any order agrees on
        q = randn(gen, len(token_seq), heads, dim, dtype=torch.float64)
        weights = randn(gen, len(token_seq), heads, scale=scale) if weights_dtype is None else randn(gen, len(token_seq), heads, dtype=weights_dtype)
        if zero_scores:
            q[..., 0] = 4.0 + q[..., 0].abs()  # every head's dot with a -8 key is far below 0, with a +8 key far above
            weights = weights.abs()
        kw["q"], kw["weights"] = q.to(dtype), weights
        if topk_margin(**kw) >= MIN_TOPK_MARGIN:
            return kw
    raise ValueError("no indexer_topk inputs with a clear top-k boundary in 100 draws")


MIN_TOPK_MARGIN = 1e-4  # relative gap at the top-k boundary: ~100x a float32 kernel's score error


def topk_margin(q, weights, index_keys, entry_rows, token_seq, num_visible, top_k, weights_scale: float = 1.0) -> float:
    """The smallest gap, over the queries seeing more than top_k entries, between the k-th and the
    (k+1)-th visible score (float64), relative to the query's largest score (inf: no such query).
    A boundary among scores of exactly 0 is no gap: those rank by entry id."""
    if entry_rows.shape[1] == 0:
        return float("inf")
    keys = kv_cache_format.dequantize_rows(index_keys, torch.float64)[entry_rows.long()[token_seq.long()].clamp(min=0)]
    scores = (torch.relu(torch.einsum("thd,ted->the", q.double(), keys)) * (weights.double() * weights_scale)[..., None]).sum(dim=1)
    margin = float("inf")
    for row, visible in zip(scores, num_visible.tolist()):
        if visible > top_k:
            ranked = row[:visible].sort(descending=True).values
            if ranked[top_k - 1] != 0:
                margin = min(margin, float((ranked[top_k - 1] - ranked[top_k]) / ranked.abs().max()))
    return margin


# ---------------------------------------------------------------------------------- hc_pre, hc_head and hc_post


def residual_streams(gen, dtype, tokens: int, streams: int, dim: int, scale: float, spread: float | None) -> torch.Tensor:
    """[T, N, D] streams of magnitude `scale`: independent (spread None), or as a trained model's,
    one hidden state (the embedding is copied into every stream) with per-stream deviations of
    `spread` times its size."""
    if spread is None:
        return randn(gen, tokens, streams, dim, dtype=dtype, scale=scale)
    common = randn(gen, tokens, 1, dim, dtype=torch.float64)
    return ((common + spread * randn(gen, tokens, streams, dim, dtype=torch.float64)) * scale).to(dtype)


def hc_pre_inputs(
    gen, dtype, *, tokens: int, streams: int = 4, dim: int, sinkhorn_iters: int = 20, x_scale: float = 1.0, spread: float | None = None, mix_scale: float = 1.0,
    norm: bool = False,
):
    """Residual streams and the block's mixing parameters (float32): fn scaled so that the mixing
    logits of the normalised streams are O(1) (times `mix_scale`), biases and scales of the size
    trained ones have; with `norm`, the block's RMSNorm weight (float32, around 1), drawn last."""
    width = (2 + streams) * streams
    inputs = {
        "x": residual_streams(gen, dtype, tokens, streams, dim, x_scale, spread),
        "fn": randn(gen, width, streams * dim, scale=mix_scale * (streams * dim) ** -0.5),
        "base": randn(gen, width, scale=0.5),
        "scale": (torch.tensor([0.5, 0.5, 1.0], dtype=torch.float64) + randn(gen, 3, dtype=torch.float64, scale=0.1)).float(),
        "norm_eps": 1e-6,
        "hc_eps": 1e-6,
        "sinkhorn_iters": sinkhorn_iters,
    }
    if norm:
        inputs["norm_weight"] = (1.0 + randn(gen, dim, dtype=torch.float64, scale=0.5)).float()
    return inputs


def hc_head_inputs(gen, dtype, *, tokens: int, streams: int = 4, dim: int, x_scale: float = 1.0, spread: float | None = None):
    """The last block's streams and a head's parameters (float32), as `hc_pre_inputs` draws a block's: fn [N, N*D]
    scaled so that the mixing logits are O(1), base [N], scale [1], and the final norm's weight around 1."""
    return {
        "x": residual_streams(gen, dtype, tokens, streams, dim, x_scale, spread),
        "fn": randn(gen, streams, streams * dim, scale=(streams * dim) ** -0.5),
        "base": randn(gen, streams, scale=0.5),
        "scale": (0.5 + randn(gen, 1, dtype=torch.float64, scale=0.1)).float(),
        "norm_weight": (1.0 + randn(gen, dim, dtype=torch.float64, scale=0.5)).float(),
        "norm_eps": 1e-6,
        "hc_eps": 1e-6,
    }


def hc_post_inputs(gen, dtype, *, tokens: int, streams: int = 4, dim: int, x_scale: float = 1.0, spread: float | None = None, y_scale: float = 1.0):
    """A block's output, the streams before it, and mixings as hc_pre makes them: post in (0, 2),
    comb near doubly stochastic (a row softmax, then a few Sinkhorn rounds), neither symmetric."""
    comb = torch.softmax(randn(gen, tokens, streams, streams, dtype=torch.float64, scale=2.0), dim=-1)
    for _ in range(3):
        comb = comb / comb.sum(dim=-2, keepdim=True)
        comb = comb / comb.sum(dim=-1, keepdim=True)
    return {
        "y": randn(gen, tokens, dim, dtype=dtype, scale=y_scale),
        "x": residual_streams(gen, dtype, tokens, streams, dim, x_scale, spread),
        "post": (2 * torch.sigmoid(randn(gen, tokens, streams, dtype=torch.float64))).float(),
        "comb": comb.float(),
    }


# ------------------------------------------------------------------------------ clamped_silu_and_mul


def clamped_silu_inputs(gen, dtype, *, tokens: int, inter: int, scale: float = 1.0, limit: float = SWIGLU_LIMIT):
    return {"x": randn(gen, tokens, 2 * inter, dtype=dtype, scale=scale), "limit": limit}


# Heads per sink: far below every score (no sink), typical, and far above (the sink takes most of the mass).
SINKS_H16 = [-30.0, -8.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0]

RECIPES = [
    # sparse_attention: the window alone (sliding layers), decode and a prefill from position 0, at V4's head_dim 512
    # (as the sinks case and the FP8 copies of the decode and the CSA case, fp8_kv_cache.py); the HCA and CSA cases
    # take 128 (the windows' 128 rows make their caches, and what they test is not the width).
    ("sparse_attention", "decode_t1_h16_d512_window128", partial(sparse_attention_inputs, seqs=[(190, 1)], heads=16)),
    ("sparse_attention", "prefill_from_0_t6_h8_d512_leading_padding", partial(sparse_attention_inputs, seqs=[(0, 6)], heads=8)),
    # HCA: every complete entry (ratio 128), two sequences with 2 and 3 entries.
    ("sparse_attention", "hca_t4_h16_d128_all_visible_entries",
     partial(sparse_attention_inputs, seqs=[(260, 2), (390, 1)], heads=16, dim=128, extra="hca", ratio=128)),
    # CSA: the indexer's top-32 of the visible entries (ratio 4), fewer than 32 visible early on: 160 keys.
    ("sparse_attention", "csa_t6_h8_d128_top32_shuffled_padding",
     partial(sparse_attention_inputs, seqs=[(40, 2), (140, 3), (3, 1)], heads=8, dim=128, extra="csa", ratio=4, topk=32)),
    ("sparse_attention", "sinks_large_and_small_t3_h16_d512_peaky",
     partial(sparse_attention_inputs, seqs=[(125, 3)], heads=16, extra="csa", ratio=4, topk=32, sinks=SINKS_H16, q_scale=3.0)),
    # A query listing no row (zeros), and extra ids equal to the window's ids (other cache's rows).
    ("sparse_attention", "empty_query_same_ids_both_caches_t4_h4_d64",
     partial(sparse_attention_inputs, seqs=[(70, 4)], heads=4, dim=64, window=32, block_size=16, same_ids=True, empty_queries=(1,))),
    # V4 decode's HCA lists: E_max columns, each query's visible entries counted by extra_lengths and real rows after them
    # (never read); the second query sees no entry yet (length 0). Under the interpreter (4 "SMs") the two queries take
    # 4 splits of 32-row blocks, the first query's last one empty (its 6 blocks run 2 a split).
    ("sparse_attention", "hca_lengths_t2_h16_d128_emax96_garbage_past_length",
     partial(sparse_attention_inputs, seqs=[(5119, 1), (60, 1)], heads=16, dim=128, extra="hca", ratio=128, lengths=True, extra_width=96)),
    # The output's rope channels rotated back in the op (out_positions), on the inputs of the cases above (stored once):
    # under the interpreter the split partials' combine rotates (the lengths case), and a query that lists no row.
    ("sparse_attention", "hca_lengths_t2_h16_d128_emax96_out_rotated_r64",
     drawn_as("sparse_attention.hca_lengths_t2_h16_d128_emax96_garbage_past_length", with_output_rotation(
         partial(sparse_attention_inputs, seqs=[(5119, 1), (60, 1)], heads=16, dim=128, extra="hca", ratio=128, lengths=True, extra_width=96), 64))),
    ("sparse_attention", "empty_query_same_ids_t4_h4_d64_out_rotated_r16",
     drawn_as("sparse_attention.empty_query_same_ids_both_caches_t4_h4_d64", with_output_rotation(
         partial(sparse_attention_inputs, seqs=[(70, 4)], heads=4, dim=64, window=32, block_size=16, same_ids=True, empty_queries=(1,)), 16))),
    ("sparse_attention", "scattered_padding_t5_h4_d64_k160",
     partial(sparse_attention_inputs, seqs=[(150, 3), (500, 2)], heads=4, dim=64, extra="csa", ratio=4, topk=32, scatter_padding=0.3, empty_queries=(4,))),
    # compress_kv: CSA (ratio 4, overlapping windows of 2 x 4 slots), first windows and continued ones.
    ("compress_kv", "csa_ratio4_d512_overlap_first_windows",
     partial(compress_kv_inputs, ratio=4, overlap=True, dim=HEAD_DIM, seqs=[(0, 3), (5, 2), (0, 1)])),
    ("compress_kv", "csa_ratio4_d128_overlap_indexer_prefill", partial(compress_kv_inputs, ratio=4, overlap=True, dim=INDEX_DIM, seqs=[(0, 16)])),
    ("compress_kv", "csa_ratio4_d64_overlap_large_gate_shuffled",
     partial(compress_kv_inputs, ratio=4, overlap=True, dim=64, seqs=[(0, 2), (9, 3)], gate_scale=30.0, bias_scale=5.0, shuffle=True)),
    # HCA (ratio 128, one window per entry; 128 channels: the cuda kernel's 4 channel blocks of 32 on a GPU, where
    # V4's 512 would be 16) and a ratio of 16 with a gate range that overflows a naive exp.
    ("compress_kv", "hca_ratio128_d128", partial(compress_kv_inputs, ratio=128, overlap=False, dim=128, seqs=[(0, 1), (3, 1)])),
    ("compress_kv", "ratio16_d64_large_gate",
     partial(compress_kv_inputs, ratio=16, overlap=False, dim=64, seqs=[(0, 2), (4, 1)], gate_scale=30.0, bias_scale=5.0)),
    # A decode step over the ring (deepinfer.model.deepseek_v4.decode_plan): one entry per sequence, -1 (skipped: zeros)
    # where no window closes or the row is padding; a first window, a previous window past the current one in the ring (a ring of 3 windows).
    ("compress_kv", "decode_ring_csa_ratio4_d32_skipped",
     partial(compress_kv_ring_inputs, ratio=4, overlap=True, dim=32, ring=12, positions=[3, 5, 11, None, 15, 6, 23])),
    ("compress_kv", "decode_ring_hca_ratio128_d16_skipped",
     partial(compress_kv_ring_inputs, ratio=128, overlap=False, dim=16, ring=128, positions=[127, None, 130, 383])),
    # kv_cache_write into the compressor ring (decode_plan): rows without a rope part, padding.
    ("kv_cache_write", "decode_ring_f32_w128_no_rope_padding", partial(ring_write_inputs, slots=3, ring=12, width=128, rows=[3, -1, 35, 12])),
    # norm_rope_kv_write: the compressor's emission into a CSA pool (16 rows a block) and an HCA pool (1 row a block), a
    # decode step's skipped rows among them; the indexer's keys from rows in the case dtype; rope over every channel.
    ("norm_rope_kv_write", "csa_d512_r64_decode_skipped",
     partial(norm_rope_write_inputs, dim=HEAD_DIM, rope_dim=64, rows_per_block=16, pool_rows=[3, -1, 21, -1, 17])),
    ("norm_rope_kv_write", "hca_d512_r64_large_entries",
     partial(norm_rope_write_inputs, dim=HEAD_DIM, rope_dim=64, rows_per_block=1, pool_rows=[5, 0, 2], x_scale=100.0)),
    ("norm_rope_kv_write", "indexer_d128_r64_rows_in_case_dtype",
     partial(norm_rope_write_inputs, dim=INDEX_DIM, rope_dim=64, rows_per_block=16, pool_rows=[-1, 33, 4, 20], x_dtype=None)),
    ("norm_rope_kv_write", "d16_all_rope", partial(norm_rope_write_inputs, dim=16, rope_dim=16, rows_per_block=4, pool_rows=[2, 7])),
    # head_norm_rope: V4's query heads (512 wide, rope 64), normed and rotated, 3 heads (a masked head block); the
    # indexer's (128 wide), rotated only; a head that is all rope.
    ("head_norm_rope", "q_t2_h3_d512_r64_normed", partial(head_norm_rope_inputs, tokens=2, heads=3, dim=HEAD_DIM, normed=True, x_scale=30.0)),
    ("head_norm_rope", "indexer_t2_h5_d128_r64_rope_only", partial(head_norm_rope_inputs, tokens=2, heads=5, dim=INDEX_DIM, normed=False)),
    ("head_norm_rope", "t3_h2_d16_all_rope_normed", partial(head_norm_rope_inputs, tokens=3, heads=2, dim=16, normed=True)),
    # indexer_topk: V4's 64 heads of 128.
    ("indexer_topk", "decode_t1_h64_d128_e100_top32", partial(indexer_topk_inputs, seqs=[(400, 1)], top_k=32)),
    # Three sequences, their own tables; queries seeing 0, fewer than top_k and more than top_k entries.
    ("indexer_topk", "prefill_b3_h16_d128_top16_mixed_visibility",
     partial(indexer_topk_inputs, seqs=[(0, 6), (60, 3), (90, 4)], top_k=16, heads=16)),
    ("indexer_topk", "top_k_above_entries_b2_h16_d64", partial(indexer_topk_inputs, seqs=[(80, 2), (30, 2)], top_k=64, heads=16, dim=64)),
    # More than top_k entries score exactly 0 (relu): the boundary falls among them, decided by lowest entry id.
    ("indexer_topk", "ties_at_zero_lowest_id_b2_h2_d16",
     partial(indexer_topk_inputs, seqs=[(120, 2), (70, 1)], top_k=24, heads=2, dim=16, zero_scores=0.6)),
    # Early in the sequences: no window complete yet, so no entry at all (E = 0).
    ("indexer_topk", "no_complete_window_b2_h64_d128", partial(indexer_topk_inputs, seqs=[(0, 2), (1, 1)], top_k=32)),
    ("indexer_topk", "ratio4_b2_h64_d128_top64_long", partial(indexer_topk_inputs, seqs=[(1000, 2), (511, 1)], top_k=64)),
    # The model's weights: weights_proj's bfloat16 output, the heads' scales in weights_scale (converted and scaled in the
    # kernel); negated, which reverses the ranking (a positive scale alone would not change the top-k).
    ("indexer_topk", "bf16_weights_negative_scale_b2_h4_d32_top8",
     partial(indexer_topk_inputs, seqs=[(40, 2), (25, 1)], top_k=8, heads=4, dim=32, weights_dtype=torch.bfloat16, scale_sign=-1.0)),
    # hc_pre: one decode token whose streams span many split segments (72 of 128 on cuda, 36 of 256 on ascend; the
    # combine's tile padded to a power of two) and, under the interpreter, two collapse splits, the second partial:
    # 2 streams of 4608, whose mixing weights are a third of 4 streams' (V4-Flash's 4 x 4096 is `deepinfer bench ops`'
    # size); one decode token whose last split segment is partial (K = 4200); V4's 4 streams at smaller widths, one
    # Sinkhorn round.
    ("hc_pre", "t1_n2_d4608_sinkhorn20", partial(hc_pre_inputs, tokens=1, streams=2, dim=4608)),
    ("hc_pre", "t1_n2_d2100_partial_segment", partial(hc_pre_inputs, tokens=1, streams=2, dim=2100)),
    ("hc_pre", "t7_n4_d64_sinkhorn20", partial(hc_pre_inputs, tokens=7, dim=64)),
    ("hc_pre", "t5_n4_d512_sinkhorn1", partial(hc_pre_inputs, tokens=5, dim=512, sinkhorn_iters=1)),
    # The block's RMSNorm folded in (norm_weight), on the streams of the cases above (their inputs, post and comb are
    # stored once): the split launch with two collapse splits under the interpreter (each needs the whole row's
    # statistics), and the fused launch over a 7-token tile.
    ("hc_pre", "t1_n2_d2100_partial_segment_normed",
     drawn_as("hc_pre.t1_n2_d2100_partial_segment", partial(hc_pre_inputs, tokens=1, streams=2, dim=2100, norm=True))),
    ("hc_pre", "t7_n4_d64_sinkhorn20_normed", drawn_as("hc_pre.t7_n4_d64_sinkhorn20", partial(hc_pre_inputs, tokens=7, dim=64, norm=True))),
    # A deep layer's streams: one large hidden state (x100) shared with 10% deviations, peaky mixings.
    ("hc_pre", "t3_n4_d256_large_residual_peaky_mix", partial(hc_pre_inputs, tokens=3, dim=256, x_scale=100.0, spread=0.1, mix_scale=4.0)),
    # hc_head: one decode token past one 1024-wide segment (K = 1088: cuda's split launch, 9 segments of 128, the last
    # partial; ascend's 5 of 256), its norm folded into the collapse; a deep layer's streams over a 3-token tile
    # (K = 192: cuda's fused launch, then its norm kernel).
    ("hc_head", "t1_n2_d544_split", partial(hc_head_inputs, tokens=1, streams=2, dim=544)),
    ("hc_head", "t3_n4_d48_large_residual", partial(hc_head_inputs, tokens=3, dim=48, x_scale=100.0, spread=0.1)),
    # hc_post
    ("hc_post", "t1_n4_d4096", partial(hc_post_inputs, tokens=1, dim=4096)),
    ("hc_post", "t9_n4_d512", partial(hc_post_inputs, tokens=9, dim=512)),
    ("hc_post", "t4_n4_d64_large_residual", partial(hc_post_inputs, tokens=4, dim=64, x_scale=100.0, spread=0.1, y_scale=3.0)),
    # clamped_silu_and_mul: V4's limit (10), values within it, and far beyond on both sides.
    ("clamped_silu_and_mul", "t1_i2048_limit10", partial(clamped_silu_inputs, tokens=1, inter=2048)),
    ("clamped_silu_and_mul", "t33_i512_limit10_beyond", partial(clamped_silu_inputs, tokens=33, inter=512, scale=25.0)),
    ("clamped_silu_and_mul", "t5_i256_limit7_beyond", partial(clamped_silu_inputs, tokens=5, inter=256, scale=15.0, limit=7.0)),
]  # fmt: skip

CASES = [Case(op, name, dtype, make) for op, name, make in RECIPES for dtype in DTYPES]
