"""Attention ops: MLA decode over the paged latent cache, var-len causal prefill, cache writes.

The latent KV cache holds, per token and layer, `kv_lora_rank` compressed values followed by
`qk_rope_head_dim` rotated key values (512 + 64 = 576 for DeepSeek-V3), in pages of `block_size`
tokens: `kv_cache: [num_blocks, block_size, kv_lora_rank + rope_dim]`. Slot `s` is
`(s // block_size, s % block_size)`. A request's block table lists its pages in order.
An FP8 cache (float8_e4m3fn) has rows 16 bytes wider: the values in e4m3, the token's float32
scale and padding (deepinfer.ops.kv_cache_format); every op here reads and writes both formats.
"""

from __future__ import annotations

import torch

from deepinfer.ops import kv_cache_format
from deepinfer.registry import ALLCLOSE, op


def dequantized_cache(kwargs, outputs):
    """An FP8 cache compares by its values (e4m3 times the row's scale, float32), not by its raw
    bytes; any other cache as it is (in its own dtype: a bfloat16 cache's golden is half the bytes
    of its float32 copy)."""
    cache = outputs["kv_cache"]
    return {"kv_cache": kv_cache_format.dequantize_rows(cache) if kv_cache_format.is_fp8(cache) else cache}


@op(family="attention", outputs=("kv_cache",), compare=ALLCLOSE, in_place="kv_cache", canonicalize=dequantized_cache)
def kv_cache_write(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Write token t's latent `kv_c[t]` ([C]) and rotated key `k_pe[t]` ([R]) into slot `slot_mapping[t]`.

    kv_c: [T, C]; k_pe: [T, R]; kv_cache: [num_blocks, block_size, C + R], written in place and
    returned; slot_mapping: [T] int64, a negative slot skips the token (padding). Values are cast to
    the cache dtype; an FP8 cache ([..., C + R + 16] float8_e4m3fn) gets each row quantised with its
    own scale (kv_cache_format.quantize_rows). Rows of slots no token names are left untouched; the
    non-negative slots must be distinct and below num_blocks * block_size.
    """
    num_blocks, block_size, _ = kv_cache.shape
    check_kv_cache_write_shapes(kv_c, k_pe, kv_cache, slot_mapping)
    written = slot_mapping >= 0
    slots = slot_mapping[written].long()
    if slots.numel() and int(slots.max()) >= num_blocks * block_size:
        raise ValueError(f"slot {int(slots.max())} is past the cache's {num_blocks * block_size} slots")
    rows = torch.cat((kv_c[written], k_pe[written]), dim=-1)
    rows = kv_cache_format.quantize_rows(rows) if kv_cache_format.is_fp8(kv_cache) else rows.to(kv_cache.dtype)
    kv_cache[slots // block_size, slots % block_size] = rows
    return kv_cache


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _visible_keys(query_positions: torch.Tensor, num_keys: int, sliding_window: int | None) -> torch.Tensor:
    """[Q, num_keys] bool: key j is visible from position p iff j <= p (and j > p - sliding_window)."""
    keys = torch.arange(num_keys, device=query_positions.device)
    visible = keys[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        visible &= keys[None, :] > query_positions[:, None] - sliding_window
    return visible


def check_kv_cache_write_shapes(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`kv_cache_write`'s shapes (no host synchronisation): every backend's check."""
    width = kv_cache_format.value_width(kv_cache)
    if kv_c.shape[-1] + k_pe.shape[-1] != width:
        raise ValueError(f"kv_c ({kv_c.shape[-1]}) + k_pe ({k_pe.shape[-1]}) widths do not match the cache row ({width})")
    if not kv_c.shape[0] == k_pe.shape[0] == slot_mapping.shape[0]:
        raise ValueError(f"kv_c, k_pe and slot_mapping disagree on the token count: {kv_c.shape[0]}, {k_pe.shape[0]}, {slot_mapping.shape[0]}")


def check_mla_decode_shapes(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, sliding_window: int | None) -> None:
    """`mla_decode`'s shapes and window (no host synchronisation): every backend's check."""
    if q_rope.shape[:3] != q_nope.shape[:3]:
        raise ValueError(f"q_rope {tuple(q_rope.shape)} does not match q_nope {tuple(q_nope.shape)} in [B, S, H]")
    width = kv_cache_format.value_width(kv_cache)
    if q_nope.shape[-1] + q_rope.shape[-1] != width:
        raise ValueError(f"q_nope ({q_nope.shape[-1]}) + q_rope ({q_rope.shape[-1]}) widths do not match the cache row ({width})")
    _check_window(sliding_window)


def check_prefill_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, sliding_window: int | None
) -> None:
    """`prefill`'s shapes and window (no host synchronisation): every backend's check."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"prefill wants q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:2] != v.shape[:2] or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit [Tq, H, Dqk], [Tk, H, Dqk], [Tk, H, Dv]")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} must both be [B+1]")
    _check_window(sliding_window)


def _check_window(sliding_window: int | None) -> None:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")


def _cached_rows(kv_cache: torch.Tensor, pages: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first num_tokens cache rows of one request, gathered in order from its pages: [num_tokens, C + R]."""
    block_size = kv_cache.shape[1]
    num_pages = -(-num_tokens // block_size)
    if num_pages > pages.shape[0]:
        raise ValueError(f"{num_tokens} cached tokens need {num_pages} pages, the block table has {pages.shape[0]}")
    return kv_cache[pages[:num_pages].long()].flatten(0, 1)[:num_tokens]


@op(family="attention", outputs=("out",), compare=ALLCLOSE, reduction_length=lambda kw: int(kw["seq_lens"].max()))
def mla_decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Absorbed multi-head latent attention over the paged latent cache (FlashMLA's contract).

    q_nope: [B, S, H, C], the no-position part of each query already multiplied by W_UK (so it lives
    in the latent space); q_rope: [B, S, H, R], rotated. S >= 1 query tokens per request (S > 1 for
    MTP / speculative verification). kv_cache: [num_blocks, block_size, C + R] (C + R + 16 for FP8); block_table:
    [B, max_blocks] int32; seq_lens: [B] int32, the number of cached tokens of each request, the
    request's S new tokens included (they are written before the call), so seq_lens[b] >= S.
    Token j of request b is row j % block_size of page block_table[b, j // block_size].

    Query s of request b sits at position p = seq_lens[b] - S + s and sees cached tokens j with
    j <= p (and j > p - sliding_window when a window is given, sliding_window >= 1). With c_j the
    first C values of token j's cache row and k_j the last R:
        score_j = (q_nope . c_j + q_rope . k_j) * softmax_scale,  out = sum_j softmax(score)_j c_j.
    Returns [B, S, H, C] in q's dtype (the caller applies W_UV). Accumulates in float32 (float64
    when q is float64; the cache is upcast to the same dtype, whatever its own; FP8 rows are
    dequantised with their scale first).
    """
    batch, num_queries, heads, latent_dim = q_nope.shape
    check_mla_decode_shapes(q_nope, q_rope, kv_cache, sliding_window)
    if seq_lens.numel() and int(seq_lens.min()) < num_queries:
        raise ValueError(f"every seq_len must count the request's {num_queries} new tokens, got {seq_lens.tolist()}")
    acc = _accumulation_dtype(q_nope)
    out = torch.empty(batch, num_queries, heads, latent_dim, dtype=acc, device=q_nope.device)
    for b in range(batch):
        num_tokens = int(seq_lens[b])
        rows = kv_cache_format.dequantize_rows(_cached_rows(kv_cache, block_table[b], num_tokens), acc)
        latents, rope_keys = rows[:, :latent_dim], rows[:, latent_dim:]
        scores = (q_nope[b].to(acc) @ latents.T + q_rope[b].to(acc) @ rope_keys.T) * softmax_scale  # [S, H, N]
        positions = num_tokens - num_queries + torch.arange(num_queries, device=q_nope.device)
        visible = _visible_keys(positions, num_tokens, sliding_window)  # [S, N]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out[b] = torch.softmax(scores, dim=-1) @ latents
    return out.to(q_nope.dtype)


@op(family="attention", outputs=("out",), compare=ALLCLOSE, reduction_length=lambda kw: int((kw["cu_seqlens_k"][1:] - kw["cu_seqlens_k"][:-1]).max()))
def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Var-len causal attention of new tokens over a cached prefix plus themselves.

    q: [Tq, H, Dqk]; k: [Tk, H, Dqk]; v: [Tk, H, Dv] (DeepSeek's naive MLA path: Dqk 192, Dv 128).
    cu_seqlens_q / cu_seqlens_k: [B+1] int32 prefix sums starting at 0 and ending at Tq / Tk;
    request b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and its keys rows
    cu_seqlens_k[b]:cu_seqlens_k[b+1], with q_len_b <= k_len_b. Causality is aligned at the end
    (flash-attn's varlen convention): query i of request b sits at key position k_len_b - q_len_b + i
    and sees keys j <= that position (and j > position - sliding_window when a window is given,
    sliding_window >= 1).
    Returns [Tq, H, Dv] in q's dtype. Accumulates in float32 (float64 when q is float64).
    """
    check_prefill_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, sliding_window)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if starts_q[0] != 0 or starts_k[0] != 0 or starts_q[-1] != q.shape[0] or starts_k[-1] != k.shape[0]:
        raise ValueError(f"cu_seqlens_q {starts_q} / cu_seqlens_k {starts_k} must both run from 0 to Tq={q.shape[0]} / Tk={k.shape[0]}")
    acc = _accumulation_dtype(q)
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=acc, device=q.device)
    for b in range(len(starts_q) - 1):
        q_rows, k_rows = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        q_len, k_len = q_rows.stop - q_rows.start, k_rows.stop - k_rows.start
        if not 0 <= q_len <= k_len:
            raise ValueError(f"request {b} has {q_len} queries and {k_len} keys; need 0 <= q_len <= k_len")
        queries, keys, values = (x.to(acc).transpose(0, 1) for x in (q[q_rows], k[k_rows], v[k_rows]))  # [H, len, D]
        scores = queries @ keys.transpose(1, 2) * softmax_scale  # [H, q_len, k_len]
        positions = k_len - q_len + torch.arange(q_len, device=q.device)
        scores = scores.masked_fill(~_visible_keys(positions, k_len, sliding_window), float("-inf"))
        out[q_rows] = (torch.softmax(scores, dim=-1) @ values).transpose(0, 1)
    return out.to(q.dtype)
