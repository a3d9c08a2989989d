"""DeepSeek-V4.1's hierarchical candidate selection: the indexer's top-k restricted to blocks of entries.

V4.1's candidate source layer (layer 20 in the release) scores every visible compressed entry with its
indexer, as any index source does, and also keeps the best `top_blocks` blocks of `block_size`
consecutive entries (a block scores the max of its entries; the block holding the query's newest
visible entry is always kept). Later Reindex layers select their own top-k only inside those blocks,
so their cost is bounded by the kept blocks, not by the context.
"""

from __future__ import annotations

import torch

from deepinfer.ops.indexer import _top_rows, check_indexer_topk_shapes, index_scores
from deepinfer.ops.sparse_attention import V41
from deepinfer.registry import EXACT, op


def _sorted_blocks(kwargs, outputs):
    """The kept set is the contract, not its order: ids ascending, the -1 padding last."""
    blocks = outputs["blocks"].long()
    key = torch.where(blocks < 0, torch.iinfo(torch.int64).max, blocks)
    return {"blocks": blocks.gather(-1, key.sort(dim=-1).indices).to(torch.int32)}


def _sorted_rows(kwargs, outputs):
    rows = outputs["topk_rows"].long()
    key = torch.where(rows < 0, torch.iinfo(torch.int64).max, rows)
    return {"topk_rows": rows.gather(-1, key.sort(dim=-1).indices).to(torch.int32)}


@op(
    family="attention", outputs=("blocks",), compare=EXACT, canonicalize=_sorted_blocks,
    reduction_length=lambda kw: kw["q"].shape[1] * kw["q"].shape[2], model_types=V41,
)  # fmt: skip
def candidate_blocks(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    entry_rows: torch.Tensor,
    token_seq: torch.Tensor,
    num_visible: torch.Tensor,
    *,
    block_size: int,
    top_blocks: int,
    weights_scale: float = 1.0,
) -> torch.Tensor:
    """The candidate blocks of each query: [T, top_blocks] int32 block ids (block b = entries
    b * block_size .. (b + 1) * block_size - 1 of the query's sequence), -1 past the kept ones.

    q, weights, index_keys, entry_rows, token_seq, num_visible, weights_scale: as `indexer_topk`, whose score this is.
    A block's score is the max of its visible entries' scores; the block of entry num_visible - 1 scores
    +inf (always kept); blocks with no visible entry are never kept. The top_blocks best are kept; equal
    scores rank by lowest block id. The order of a row's ids is not part of the contract."""
    check_indexer_topk_shapes(q, weights, index_keys, entry_rows, token_seq, num_visible)
    if block_size < 1 or top_blocks < 1:
        raise ValueError(f"candidate_blocks wants block_size >= 1 and top_blocks >= 1, got {block_size} and {top_blocks}")
    tokens, entries = q.shape[0], entry_rows.shape[1]
    out = torch.full((tokens, top_blocks), -1, dtype=torch.int32, device=q.device)
    if tokens == 0 or entries == 0:
        return out
    scores = index_scores(q, weights, index_keys, entry_rows, token_seq, num_visible, weights_scale)
    padded = torch.nn.functional.pad(scores, (0, -entries % block_size), value=float("-inf"))
    block_scores = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)  # [T, B]
    newest = (num_visible.long() - 1) // block_size  # -1: nothing visible, no block forced
    ids = torch.arange(block_scores.shape[1], device=q.device)
    block_scores = block_scores.masked_fill(ids[None, :] == newest[:, None], float("inf"))
    k = min(top_blocks, block_scores.shape[1])
    ranked = torch.sort(block_scores, dim=-1, descending=True, stable=True)  # stable: ties by lowest id
    kept = ranked.values[:, :k] > float("-inf")
    out[:, :k] = torch.where(kept, ranked.indices[:, :k], -1).to(torch.int32)
    return out


@op(
    family="attention", outputs=("topk_rows",), compare=EXACT, canonicalize=_sorted_rows,
    reduction_length=lambda kw: kw["q"].shape[1] * kw["q"].shape[2], model_types=V41,
)  # fmt: skip
def indexer_topk_in_blocks(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    entry_rows: torch.Tensor,
    token_seq: torch.Tensor,
    num_visible: torch.Tensor,
    blocks: torch.Tensor,
    *,
    top_k: int,
    block_size: int,
    weights_scale: float = 1.0,
) -> torch.Tensor:
    """`indexer_topk` over only the entries inside each query's candidate blocks.

    blocks: [T, NB] int32 block ids per query (`candidate_blocks`' output, -1 for none). Entries outside
    every listed block score -inf; the rest as `indexer_topk` (weights and weights_scale too; visible ones
    only, top_k by score, lowest entry first on ties, -1 where fewer qualify). Returns [T, top_k] int32 rows of the entry pool."""
    check_indexer_topk_shapes(q, weights, index_keys, entry_rows, token_seq, num_visible)
    if blocks.dim() != 2 or blocks.shape[0] != q.shape[0]:
        raise ValueError(f"blocks must be [T={q.shape[0]}, NB], got {tuple(blocks.shape)}")
    tokens, entries = q.shape[0], entry_rows.shape[1]
    out = torch.full((tokens, top_k), -1, dtype=torch.int32, device=q.device)
    if tokens == 0 or entries == 0:
        return out
    scores = index_scores(q, weights, index_keys, entry_rows, token_seq, num_visible, weights_scale)
    block_of = torch.arange(entries, device=q.device) // block_size  # [E]
    inside = (block_of[None, None, :] == blocks.long()[:, :, None]).any(dim=1)  # -1 matches no block
    return _top_rows(scores.masked_fill(~inside, float("-inf")), entry_rows, token_seq, top_k, out)
