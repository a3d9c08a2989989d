"""DeepSeek-V4 attention: shared-KV multi-query attention over listed cache rows, with attention sinks.

V4 keeps one 512-wide row per token and layer (keys and values are the same row) and attends, per
query, to two sets of rows: the sliding window's last `sliding_window` tokens and the compressed
entries the layer type selects (CSA: the indexer's top-k, HCA: every complete one). Both are given
as row ids into flat caches (a paged cache viewed as [num_blocks * rows_per_block, D]), as
FlashMLA's sparse decoding takes them, so one kernel serves prefill, decode and every layer type.
"""

from __future__ import annotations

import torch

from deepinfer.ops import kv_cache_format
from deepinfer.ops.rope import rope
from deepinfer.registry import ALLCLOSE, op

V4 = ("deepseek_v4",)
V41 = ("deepseek_v41",)
V4_AND_V41 = V4 + V41  # ops both models call


def _listed_keys(kw) -> int:
    extra = kw.get("extra_indices")
    return kw["indices"].shape[1] + (0 if extra is None else extra.shape[1])


def check_sparse_attention_shapes(q, kv, indices, sinks, extra_kv, extra_indices, extra_lengths=None, out_positions=None, out_cos_sin_cache=None) -> None:
    """`sparse_attention`'s shapes (no host synchronisation): every backend's check."""
    if q.dim() != 3 or kv.dim() != 2 or indices.dim() != 2:
        raise ValueError(f"sparse_attention wants q [T, H, D], kv [N, D], indices [T, K]; got {tuple(q.shape)}, {tuple(kv.shape)}, {tuple(indices.shape)}")
    if kv_cache_format.value_width(kv) != q.shape[2] or indices.shape[0] != q.shape[0]:
        raise ValueError(f"q {tuple(q.shape)}, kv {tuple(kv.shape)} and indices {tuple(indices.shape)} disagree on D or T")
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [H={q.shape[1]}], got {tuple(sinks.shape)}")
    if (extra_kv is None) != (extra_indices is None):
        raise ValueError("extra_kv and extra_indices go together")
    if extra_kv is not None and (extra_kv.dim() != 2 or kv_cache_format.value_width(extra_kv) != q.shape[2] or extra_indices.shape[0] != q.shape[0]):
        raise ValueError(f"extra_kv {tuple(extra_kv.shape)} / extra_indices {tuple(extra_indices.shape)} do not fit q {tuple(q.shape)}")
    if extra_lengths is not None and (extra_indices is None or extra_lengths.shape != (q.shape[0],)):
        raise ValueError(f"extra_lengths must be [T={q.shape[0]}] beside extra_indices, got {tuple(extra_lengths.shape)}")
    if (out_positions is None) != (out_cos_sin_cache is None):
        raise ValueError("out_positions and out_cos_sin_cache go together")
    if out_positions is not None:
        rope_dim = out_cos_sin_cache.shape[-1]
        if out_positions.shape != (q.shape[0],) or out_cos_sin_cache.dim() != 2 or rope_dim % 2 or rope_dim > q.shape[2] or q.shape[2] % 2:
            raise ValueError(
                f"out_positions must be [T={q.shape[0]}] and out_cos_sin_cache [max_positions, R], R even and at most D={q.shape[2]} (even); "
                f"got {tuple(out_positions.shape)} and {tuple(out_cos_sin_cache.shape)}"
            )


def _gather(rows: torch.Tensor, indices: torch.Tensor, acc: torch.dtype, lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K, D] rows (zeros where the id is -1 or past the row's length) and the [T, K] validity mask."""
    if lengths is not None:  # ids past a row's length are not read, whatever they hold
        indices = indices.masked_fill(torch.arange(indices.shape[1], device=indices.device)[None, :] >= lengths.long()[:, None], -1)
    valid = indices >= 0
    if indices.numel() and int(indices.max()) >= rows.shape[0]:
        raise ValueError(f"row id {int(indices.max())} is past the cache's {rows.shape[0]} rows")
    picked = kv_cache_format.dequantize_rows(rows[indices.clamp(min=0).long()], acc)
    return picked * valid[..., None], valid


@op(family="attention", outputs=("out",), compare=ALLCLOSE, reduction_length=_listed_keys, model_types=V4_AND_V41)
def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    *,
    softmax_scale: float,
    extra_kv: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lengths: torch.Tensor | None = None,
    out_positions: torch.Tensor | None = None,
    out_cos_sin_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each query over the rows it lists, keys and values being the same rows.

    q: [T, H, D]; kv: [N, D]; indices: [T, K] int32, the rows of kv query t attends to, -1 for none
    (a row listed twice counts twice: callers list each once); an FP8 kv ([N, D + 16] float8_e4m3fn,
    deepinfer.ops.kv_cache_format) is dequantised row by row. extra_kv: [M, D] and extra_indices:
    [T, K2] likewise, a second cache attended in the same softmax (V4's compressed entries).
    extra_lengths: [T] int32, optional: query t lists only extra_indices[t, :extra_lengths[t]] (the
    ids after are never read, whatever they hold), so a list padded to a batch's widest (V4 decode
    plans E_max entries per sequence) costs its valid rows only; None: every column.
    sinks: [H] float32, one logit per head that joins every softmax without a value (gpt-oss and V4's
    attention sinks). With s_j = (q_t,h . row_j) * softmax_scale over every listed row j:
        out[t, h] = sum_j exp(s_j) row_j / (exp(sinks[h]) + sum_j exp(s_j)).
    A query that lists no row gets zeros. Returns [T, H, D] in q's dtype; accumulates in float32
    (float64 for float64 q).
    out_positions: [T] int64 and out_cos_sin_cache: [max_positions, R] float32 (`rope`'s table, R
    even, R <= D), optional and together: then out's last R channels, rounded to q's dtype, are
    rotated in DeepSeek's interleaved pairs at out_positions[t] (`rope`, interleaved=True) and rounded
    again: bit for bit what `rope` on the returned tail gives. V4 passes the inverse table (cos, -sin)
    and the query's positions: the values carried their key's rotation, which this undoes. In the op
    rather than after it: the rotation is a launch (and a copy back) of its own, while the kernels
    already hold every output row in their last step.
    """
    check_sparse_attention_shapes(q, kv, indices, sinks, extra_kv, extra_indices, extra_lengths, out_positions, out_cos_sin_cache)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows, valid = _gather(kv, indices, acc)
    if extra_kv is not None:
        extra_rows, extra_valid = _gather(extra_kv, extra_indices, acc, extra_lengths)
        rows, valid = torch.cat((rows, extra_rows), dim=1), torch.cat((valid, extra_valid), dim=1)
    scores = torch.einsum("thd,tkd->thk", q.to(acc), rows) * softmax_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.to(acc)[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("thk,tkd->thd", probs, rows).to(q.dtype)
    if out_positions is not None:
        nope = q.shape[2] - out_cos_sin_cache.shape[-1]
        out = torch.cat((out[..., :nope], rope(out[..., nope:], out_positions, out_cos_sin_cache, interleaved=True)), dim=-1)
    return out
