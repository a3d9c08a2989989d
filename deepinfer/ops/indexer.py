"""DeepSeek-V4's Lightning Indexer: which compressed entries each query of a CSA layer attends to."""

from __future__ import annotations

import torch

from deepinfer.ops import kv_cache_format
from deepinfer.ops.sparse_attention import V4_AND_V41
from deepinfer.registry import EXACT, op


def _sorted_rows(kwargs, outputs):
    """The top-k set is the contract, not its order: rows ascending, the -1 padding last."""
    rows = outputs["topk_rows"].long()
    key = torch.where(rows < 0, torch.iinfo(torch.int64).max, rows)
    return {"topk_rows": rows.gather(-1, key.sort(dim=-1).indices).to(torch.int32)}


def check_indexer_topk_shapes(q, weights, index_keys, entry_rows, token_seq, num_visible) -> None:
    """`indexer_topk`'s shapes (no host synchronisation): every backend's check."""
    if q.dim() != 3 or weights.shape != q.shape[:2]:
        raise ValueError(f"indexer_topk wants q [T, H, D] and weights [T, H]; got {tuple(q.shape)} and {tuple(weights.shape)}")
    if not weights.is_floating_point():
        raise ValueError(f"indexer_topk wants floating-point weights, got {weights.dtype}")
    if index_keys.dim() != 2 or kv_cache_format.value_width(index_keys) != q.shape[2]:
        raise ValueError(f"index_keys must be [N, D={q.shape[2]}], got {tuple(index_keys.shape)}")
    if entry_rows.dim() != 2 or token_seq.shape != (q.shape[0],) or num_visible.shape != (q.shape[0],):
        raise ValueError(
            "entry_rows [B, E], token_seq [T] and num_visible [T] expected; "
            f"got {tuple(entry_rows.shape)}, {tuple(token_seq.shape)}, {tuple(num_visible.shape)}"
        )


@op(
    family="attention", outputs=("topk_rows",), compare=EXACT, canonicalize=_sorted_rows,
    reduction_length=lambda kw: kw["q"].shape[1] * kw["q"].shape[2], model_types=V4_AND_V41,
)  # fmt: skip
def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    entry_rows: torch.Tensor,
    token_seq: torch.Tensor,
    num_visible: torch.Tensor,
    *,
    top_k: int,
    weights_scale: float = 1.0,
) -> torch.Tensor:
    """The top_k compressed entries of each query by the indexer's score.

    q: [T, H, D] indexer queries (rotated); weights: [T, H] per-head weights in any float dtype (the
    weights projection's output as it comes, bfloat16 say); weights_scale: a constant they are
    multiplied by, after their conversion to float32 (the caller's index_n_heads^-0.5 *
    index_head_dim^-0.5: the product is the model's `weights.float() * scale`, bit for bit, with no
    launch of its own); index_keys: [N, D] the indexer's compressed keys (a paged pool viewed
    flat; FP8 rows [N, D + 16] are dequantised, deepinfer.ops.kv_cache_format); entry_rows: [B, E]
    int32, the row of each sequence's entry e; token_seq: [T] int32, the sequence of each query;
    num_visible: [T] int32, the entries 0..num_visible-1 query t may see
    (those whose window is complete at its position). score(t, e) = sum_h w[t, h] *
    relu(q[t, h] . index_keys[entry_rows[token_seq[t], e]]) with w = float32(weights) * weights_scale
    (in float32; float64 for float64 q). Returns [T, top_k] int32: the rows
    entry_rows[token_seq[t], e] of the top_k visible entries e by score (what sparse_attention lists
    over the entry pool), -1 where fewer are visible. Equal scores (relu makes exact zeros common)
    rank by lowest entry id. The order of a row's rows is not part of the contract (the conformance
    suite sorts them); scores are computed in float32.
    """
    check_indexer_topk_shapes(q, weights, index_keys, entry_rows, token_seq, num_visible)
    tokens, max_entries = q.shape[0], entry_rows.shape[1]
    out = torch.full((tokens, top_k), -1, dtype=torch.int32, device=q.device)
    if tokens == 0 or max_entries == 0:
        return out
    scores = index_scores(q, weights, index_keys, entry_rows, token_seq, num_visible, weights_scale)
    return _top_rows(scores, entry_rows, token_seq, top_k, out)


def index_scores(q, weights, index_keys, entry_rows, token_seq, num_visible, weights_scale: float = 1.0) -> torch.Tensor:
    """[T, E] the indexer's score of every entry for every query (`indexer_topk`'s), -inf where invisible;
    float32 (float64 for float64 q)."""
    tokens, max_entries = q.shape[0], entry_rows.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.empty(tokens, max_entries, dtype=acc, device=q.device)
    seq_of = token_seq.long()
    for b in range(entry_rows.shape[0]):  # each sequence's keys are read once, for all its queries
        mine = (seq_of == b).nonzero().squeeze(1)
        if mine.numel():
            keys = kv_cache_format.dequantize_rows(index_keys[entry_rows[b].long().clamp(min=0)], acc)  # [E, D]
            per_head = torch.relu(torch.einsum("thd,ed->the", q[mine].to(acc), keys))
            scores[mine] = (per_head * (weights[mine].to(acc) * weights_scale)[..., None]).sum(dim=1)
    visible = torch.arange(max_entries, device=q.device)[None, :] < num_visible.long()[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def _top_rows(scores: torch.Tensor, entry_rows: torch.Tensor, token_seq: torch.Tensor, top_k: int, out: torch.Tensor) -> torch.Tensor:
    """out [T, top_k] filled with the pool rows of each query's top_k finite-scored entries (-1 past them)."""
    max_entries = scores.shape[1]
    seq_of = token_seq.long()
    k = min(top_k, max_entries)
    ids = _top_ids_lowest_first(scores, k)
    rows = entry_rows.long()[seq_of[:, None], ids.clamp(min=0)]
    out[:, :k] = torch.where(ids >= 0, rows, -1).to(torch.int32)
    return out


def _top_ids_lowest_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] ids of the k largest finite scores per row (-1 past the finite ones), equal scores
    taken lowest id first: everything above the k-th value, then the lowest ids equal to it (a
    top-k, not a full sort of the row)."""
    kth = scores.topk(k, dim=-1).values[:, -1:]
    above = scores > kth
    tied = (scores == kth) & torch.isfinite(scores)
    room = k - above.sum(dim=-1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(dim=-1) <= room))
    ids = torch.arange(scores.shape[1], device=scores.device).expand_as(scores)
    # Chosen ids first, lowest first: topk over (chosen, -id) keys, which are distinct.
    key = torch.where(chosen, scores.shape[1] - ids, -1)
    picked = key.topk(k, dim=-1)
    return torch.where(picked.values > 0, scores.shape[1] - picked.values, -1)
