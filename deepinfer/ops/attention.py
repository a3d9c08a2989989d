"""Attention ops: MLA decode over the paged latent cache, var-len causal prefill, cache writes.

The latent KV cache holds, per token and layer, `kv_lora_rank` compressed values followed by
`qk_rope_head_dim` rotated key values (512 + 64 = 576 for DeepSeek-V3), in pages of `block_size`
tokens: `kv_cache: [num_blocks, block_size, kv_lora_rank + rope_dim]`. Slot `s` is
`(s // block_size, s % block_size)`. A request's block table lists its pages in order.
"""

from __future__ import annotations

import torch

from deepinfer.registry import ALLCLOSE, op


@op(family="attention", outputs=("kv_cache",), compare=ALLCLOSE, in_place="kv_cache")
def kv_cache_write(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Write token t's latent `kv_c[t]` ([C]) and rotated key `k_pe[t]` ([R]) into slot `slot_mapping[t]`.

    kv_c: [T, C]; k_pe: [T, R]; kv_cache: [num_blocks, block_size, C + R], written in place and
    returned; slot_mapping: [T] int64, a negative slot skips the token (padding). Values are cast to
    the cache dtype.
    """
    raise NotImplementedError


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
    MTP / speculative verification). kv_cache: [num_blocks, block_size, C + R]; block_table:
    [B, max_blocks] int32; seq_lens: [B] int32, the number of cached tokens of each request, the
    request's S new tokens included (they are written before the call).

    Query s of request b sits at position p = seq_lens[b] - S + s and sees cached tokens j with
    j <= p (and j > p - sliding_window when a window is given). With c_j the first C values of
    token j's cache row and k_j the last R:
        score_j = (q_nope . c_j + q_rope . k_j) * softmax_scale,  out = sum_j softmax(score)_j c_j.
    Returns [B, S, H, C] in q's dtype (the caller applies W_UV). Accumulates in float32.
    """
    raise NotImplementedError


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
    cu_seqlens_q / cu_seqlens_k: [B+1] int32 prefix sums; request b's queries are rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] and its keys rows cu_seqlens_k[b]:cu_seqlens_k[b+1], with
    q_len_b <= k_len_b. Causality is aligned at the end (flash-attn's varlen convention): query i
    of request b sits at key position k_len_b - q_len_b + i and sees keys j <= that position (and
    j > position - sliding_window when a window is given).
    Returns [Tq, H, Dv] in q's dtype. Accumulates in float32.
    """
    raise NotImplementedError
