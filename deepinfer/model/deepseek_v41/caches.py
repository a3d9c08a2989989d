"""DeepSeek-V4.1's per-sequence state, kept by owner: the simplest correct layout, one state slot per running sequence.

- every layer: a ring of the window KV of its last `sliding_window` positions (position p in row p % rows);
- KV-source (Full) layers only: the history of compressed KV entries and index keys, entry g in row g, up to
  the longest sequence the engine runs, plus the raw projections (value, gate logits) of a group's tokens
  that arrived before the group completed (ratio > 1), position p in row p % rows;
- Engram: the compressed ids of each sequence's last `engram_max_ngram_size - 1` tokens, position p in row p % rows.
The three rings hold `lookahead` rows more than they need (speculative decoding's drafts): a verification
writes the rows of its drafts, and when a draft is rejected the next step reads the rows its positions
overwrote would have held; with the slack they still hold them (ATOM sizes the window ring 128 + 5 likewise).
Reuse and Reindex layers keep no history: they read their KV source's. Values are stored in the model's
dtype after the release's cache rounding (`cache_round`), so they equal the released formats' decoded values;
storing the released formats themselves (FP8, NVFP4, MXFP4 bytes) in paged blocks is a later step.
A sequence's state is written before it is read: a step reads only positions of its own earlier steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model.deepseek_v41.config import V41Config

RAW_DTYPE = torch.float32  # the compressor computes its projections in float32 (the release keeps its weights float32)


@dataclass
class LayerState:
    ring: torch.Tensor  # [slots, window + lookahead, head_dim]
    entries: torch.Tensor | None = None  # [slots, max_entries, head_dim]: a KV source's compressed KV
    index_keys: torch.Tensor | None = None  # [slots, max_entries, index_head_dim]
    pending: torch.Tensor | None = None  # [slots, ratio + lookahead, 2 * head_dim] float32: recent tokens' projections, row = position % rows


@dataclass
class V41State:
    layers: list[LayerState]
    engram_ids: torch.Tensor | None  # [slots, max_ngram - 1 + lookahead] int64: compressed ids of the last tokens, row = position % rows


def allocate(config: V41Config, slots: int, max_positions: int, dtype: torch.dtype, device, lookahead: int = 0) -> V41State:
    c = config
    layers = []
    for role in c.roles:
        ring = torch.zeros(slots, c.sliding_window + lookahead, c.head_dim, dtype=dtype, device=device)
        state = LayerState(ring)
        if role.has_compressor:
            entries = max_positions // role.ratio
            state.entries = torch.zeros(slots, entries, c.head_dim, dtype=dtype, device=device)
            state.index_keys = torch.zeros(slots, entries, c.index_head_dim, dtype=dtype, device=device)
            state.pending = torch.zeros(slots, role.ratio + lookahead, 2 * c.head_dim, dtype=RAW_DTYPE, device=device)
        layers.append(state)
    engram = torch.zeros(slots, c.engram_max_ngram_size - 1 + lookahead, dtype=torch.int64, device=device) if c.engram_layer_ids else None
    return V41State(layers, engram)


def slot_bytes(config: V41Config, max_positions: int, dtype: torch.dtype, lookahead: int = 0) -> int:
    """Bytes one state slot takes (`allocate` with one slot)."""
    c = config
    size = torch.empty((), dtype=dtype).element_size()
    total = len(c.roles) * (c.sliding_window + lookahead) * c.head_dim * size
    for role in c.roles:
        if role.has_compressor:
            total += (max_positions // role.ratio) * (c.head_dim + c.index_head_dim) * size + (role.ratio + lookahead) * 2 * c.head_dim * 4
    return total + (8 * (c.engram_max_ngram_size - 1 + lookahead) if c.engram_layer_ids else 0)
