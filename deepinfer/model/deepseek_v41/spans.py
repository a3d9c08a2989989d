"""What a V4.1 step's layers need to know of each sequence, and the cross-layer CSA2 state handed between them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model.deepseek_v41.caches import ENTRY_FORMAT, INDEX_KEY_FORMAT, read


@dataclass(frozen=True)
class Span:
    """One sequence's new tokens in a step: rows offset .. offset + length - 1 of the step, at positions start ..."""

    slot: int  # its state slot (caches.V41State)
    start: int  # position of its first new token
    length: int
    offset: int  # its first row among the step's tokens
    window_from: int = 0  # the lowest position whose window row this layer computed (bounded_replay.py: the decoder's tail start)
    pages: torch.Tensor | None = None  # [blocks] int32 on the device: its block table, where its paged history lives (caches.py)
    cached: int = 0  # positions below this were in cached blocks when it was admitted: their history is shared, never rewritten

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.length)

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class SharedKV:
    """A sequence's CSA2 state as the layers hand it on (V4.1's attention state): a Full layer replaces all of it,
    a Reindex layer the selection only, Reuse layers read it."""

    entries: torch.Tensor | None = None  # [E, head_dim]: the KV source's compressed KV up to this step's end
    index_keys: torch.Tensor | None = None  # [E, index_head_dim]
    topk: torch.Tensor | None = None  # [length, index_topk] int32: entry ids per new token, -1 for none
    blocks: torch.Tensor | None = None  # [length, candidate_topk_blocks] int32: the candidate source's kept blocks
    ratio: int = 0


@dataclass
class SharedBatchKV:
    """A decode step's CSA2 state for the whole batch at once (decode_plan.py), handed between the layers as SharedKV is:
    a Full layer replaces all of it, a Reindex layer the selection only, Reuse layers read it. Fixed shapes: every
    sequence's E entries (its block tables' width), -1 past the visible ones."""

    entry_table: torch.Tensor | None = None  # [B, E] int32: the KV source's flat pool row of each sequence's entry e, -1 past the visible
    visible: torch.Tensor | None = None  # [B] int32: entries the sequence's token sees
    pool: torch.Tensor | None = None  # [num_blocks * rows_per_block, bytes] uint8: the KV source's stored entries, viewed flat
    index_keys: torch.Tensor | None = None  # [B * E, index_head_dim]: every sequence's index keys, read back, sequence-major
    key_rows: torch.Tensor | None = None  # [B, E] int32: b * E + e, sequence b's entry e among index_keys (what the indexer ops return)
    token_seq: torch.Tensor | None = None  # [B] int32: 0 .. B - 1, each token its own sequence
    blocks: torch.Tensor | None = None  # [B, candidate_topk_blocks] int32: the candidate source's kept blocks (entry ids // block size)
    selected: torch.Tensor | None = None  # [B * top_k, head_dim]: the selected entries, read back, token-major
    selected_indices: torch.Tensor | None = None  # [B, top_k] int32: b * top_k + j among `selected`, -1 where fewer were selected

    def take_source(self, ops, entries: torch.Tensor, index_keys: torch.Tensor, entry_table: torch.Tensor, visible: torch.Tensor,
                    key_channels: int, dtype: torch.dtype) -> None:  # fmt: skip
        """A Full layer's: its paged entries and index keys ([num_blocks, rows_per_block, bytes] each) replace the
        state, every sequence's index keys read once here for the indexers that score them (this one, Reindex layers)."""
        batch, width = entry_table.shape
        keys = index_keys.view(-1, index_keys.shape[-1])
        # torch glue: a gather of [B, E] stored keys (padding columns read the block table's row, then are never visible)
        self.index_keys = read(ops, keys[entry_table.clamp(min=0)], INDEX_KEY_FORMAT, key_channels, dtype).flatten(0, 1)
        self.entry_table, self.visible, self.pool = entry_table, visible, entries.view(-1, entries.shape[-1])
        self.key_rows = torch.arange(batch * width, dtype=torch.int32, device=entry_table.device).view(batch, width)
        self.token_seq = torch.arange(batch, dtype=torch.int32, device=entry_table.device)
        self.blocks = self.selected = self.selected_indices = None

    def select(self, ops, topk: torch.Tensor, head_dim: int, dtype: torch.dtype) -> None:
        """An indexer's selection [B, top_k] (rows of index_keys, -1 for none) as the entries it names, read back once
        here for every layer that attends with it."""
        picked = topk >= 0
        pool_rows = self.entry_table.view(-1)[topk.clamp(min=0).long()].clamp(min=0)  # torch glue: b * E + e -> its pool row
        self.selected = read(ops, self.pool[pool_rows], ENTRY_FORMAT, head_dim, dtype).flatten(0, 1)  # glue: a [B, top_k] row gather
        gathered = torch.arange(topk.numel(), dtype=torch.int32, device=topk.device).view(topk.shape)
        self.selected_indices = torch.where(picked, gathered, -1)


def rotate_tail(ops, x: torch.Tensor, rope_dim: int, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with its last rope_dim channels rotated (DeepSeek's interleaved pairs), as a new tensor."""
    out = x.clone()
    out[..., x.shape[-1] - rope_dim :] = ops.rope(x[..., x.shape[-1] - rope_dim :].contiguous(), positions, table, interleaved=True)
    return out
