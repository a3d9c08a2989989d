"""DeepSeek-V4.1's caches, kept by owner: the history in the engine's token blocks, the rest in one state slot per running sequence.

Paged (in the engine's token blocks, so prefix caching shares them, as DeepSeek-V4's compressed pools are):
- KV-source (Full) layers only: the compressed KV entries and index keys, `rows_per_block` = block_size // ratio
  per block, entry g of a sequence in row g % rows_per_block of its block g // rows_per_block: the block that holds
  the group's tokens (the ratio divides the block size, so a group never straddles two blocks and a full block's
  entries are complete once its tokens are computed).

Per sequence (a state slot, held while the sequence runs; nothing here grows with the sequence):
- every layer: a ring of the window KV of its last `sliding_window` positions (position p in row p % rows);
- KV-source layers: the raw projections (value, gate logits) of a group's tokens that arrived before
  the group completed, position p in row p % rows;
- Engram: the compressed ids of each sequence's last `engram_max_ngram_size - 1` tokens, position p in row p % rows, in
  one row more than that (`engram_rows`): a step's write never lands on a row it reads, so a decode step run again (a
  device graph's warm-ups) computes the same.
The three rings hold `lookahead` rows more than they need (speculative decoding's drafts): a verification
writes the rows of its drafts, and when a draft is rejected the next step reads the rows its positions
overwrote would have held; with the slack they still hold them (ATOM sizes the window ring 128 + 5 likewise).
Reuse and Reindex layers keep no history: they read their KV source's. Values are stored in the release's
formats (deepinfer.ops.cache_storage): the window rows FP8 e4m3 with an e8m0 scale per 32 channels, the
compressed entries NVFP4 (e2m1, an e4m3 scale per 16), the index keys MXFP4 (e2m1, an e8m0 scale per 32); the
model writes them with `cache_pack` and reads back what a step attends to with `cache_unpack` (`read`), which
gives the values `cache_round` gives, so the stored formats change no number.
A sequence's state is written before it is read: a step reads only positions of its own earlier steps, and
entries of a cached prefix's blocks (computed by the sequence that registered them).
One more state slot and one more block than asked for are scratch, never read: a decode step planned on the device
(decode_plan.py) writes there what its padding rows and its groups that do not close would write, so that every
row writes somewhere and its writes keep fixed shapes (one slot and one block beyond the engine's budget).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.ops.cache_storage import row_bytes

WINDOW_FORMAT, ENTRY_FORMAT, INDEX_KEY_FORMAT = "fp8", "nvfp4", "mxfp4"
RAW_DTYPE = torch.float32  # the compressor computes its projections in float32 (the release keeps its weights float32)


@dataclass
class LayerState:
    ring: torch.Tensor  # [slots, window + lookahead, row_bytes(head_dim, WINDOW_FORMAT)] uint8
    entries: torch.Tensor | None = None  # [num_blocks, rows_per_block, row_bytes(head_dim, ENTRY_FORMAT)] uint8: a KV source's compressed KV
    index_keys: torch.Tensor | None = None  # [num_blocks, rows_per_block, row_bytes(index_head_dim, INDEX_KEY_FORMAT)] uint8
    pending: torch.Tensor | None = None  # [slots, ratio + lookahead, 2 * head_dim] float32: recent tokens' projections, row = position % rows


@dataclass
class V41State:
    layers: list[LayerState]
    engram_ids: torch.Tensor | None  # [slots, engram_rows] int64: compressed ids of the last tokens, row = position % rows

    @property
    def scratch_slot(self) -> int:
        """The state slot no sequence owns (the last): a decode step's padding rows write their state there."""
        return self.layers[0].ring.shape[0] - 1 if self.layers else 0


def rows_per_block(block_size: int, ratio: int) -> int:
    """A KV source's entries per token block; the ratio must divide the block size (a group within one block)."""
    if block_size % ratio:
        raise ValueError(f"the KV block size {block_size} must be a multiple of every DeepSeek-V4.1 compression ratio (got ratio {ratio})")
    return block_size // ratio


def allocate(config: V41Config, num_blocks: int, block_size: int, slots: int, device, lookahead: int = 0) -> V41State:
    """Slots 0 .. slots - 1 and blocks 0 .. num_blocks - 1 for the engine's sequences, then one scratch slot and block."""
    c = config
    slots, num_blocks = slots + 1, num_blocks + 1
    layers = []
    stored = lambda *shape: torch.zeros(*shape, dtype=torch.uint8, device=device)  # noqa: E731
    for role in c.roles:
        state = LayerState(stored(slots, c.sliding_window + lookahead, row_bytes(c.head_dim, WINDOW_FORMAT)))
        if role.has_compressor:
            rows = rows_per_block(block_size, role.ratio)
            state.entries = stored(num_blocks, rows, row_bytes(c.head_dim, ENTRY_FORMAT))
            state.index_keys = stored(num_blocks, rows, row_bytes(c.index_head_dim, INDEX_KEY_FORMAT))
            state.pending = torch.zeros(slots, role.ratio + lookahead, 2 * c.head_dim, dtype=RAW_DTYPE, device=device)
        layers.append(state)
    engram = torch.zeros(slots, engram_rows(c, lookahead), dtype=torch.int64, device=device) if c.engram_layer_ids else None
    return V41State(layers, engram)


def engram_rows(config: V41Config, lookahead: int = 0) -> int:
    """Rows of a slot's Engram history: the max_ngram - 1 ids a token reads, its own, and the speculative slack."""
    return config.engram_max_ngram_size + lookahead


def history_rows(pages: torch.Tensor, first: int, end: int, per_block: int) -> torch.Tensor:
    """Rows of a paged history viewed flat ([num_blocks * per_block, bytes]) that hold a sequence's entries first .. end - 1,
    its block table `pages` [blocks] (a device tensor)."""
    entries = torch.arange(first, end, device=pages.device)
    return pages[entries // per_block].long() * per_block + entries % per_block


def read(ops, rows: torch.Tensor, fmt: str, channels: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows [..., bytes] as values [..., channels] in `dtype`."""
    return ops.cache_unpack(rows, torch.empty(*rows.shape[:-1], channels, dtype=dtype, device=rows.device), fmt=fmt)


def history_bytes_per_token(config: V41Config) -> float:
    """Bytes of history one token adds to a sequence's cache: each KV source's compressed entry and index key,
    one per `ratio` tokens (the release: 2.5 x (288 + 68) = 890)."""
    c = config
    row = row_bytes(c.head_dim, ENTRY_FORMAT) + row_bytes(c.index_head_dim, INDEX_KEY_FORMAT)
    return sum(row / role.ratio for role in c.roles if role.has_compressor)


def block_bytes(config: V41Config, block_size: int) -> int:
    """Bytes one token block takes: every KV source's entries and index keys of `block_size` tokens."""
    c = config
    row = row_bytes(c.head_dim, ENTRY_FORMAT) + row_bytes(c.index_head_dim, INDEX_KEY_FORMAT)
    return sum(rows_per_block(block_size, role.ratio) * row for role in c.roles if role.has_compressor)


def fixed_bytes_per_request(config: V41Config, lookahead: int = 0) -> int:
    """Bytes of a sequence's state that do not grow with it (a state slot): every layer's window ring, the raw
    projections of an open group (ratio > 1) and Engram's last compressed ids, each `lookahead` rows of
    speculative slack longer."""
    c = config
    total = len(c.roles) * (c.sliding_window + lookahead) * row_bytes(c.head_dim, WINDOW_FORMAT)
    total += sum((role.ratio + lookahead) * 2 * c.head_dim * RAW_DTYPE.itemsize for role in c.roles if role.has_compressor)
    return total + (8 * engram_rows(c, lookahead) if c.engram_layer_ids else 0)
