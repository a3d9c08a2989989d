"""DeepSeek-V4's caches: what each layer type keeps per token block, and per running sequence.

Paged (in the engine's token blocks, so prefix caching shares them):
- every layer: the sliding window's KV, one D-wide row per token ([num_blocks, block_size, D]);
- CSA and HCA layers: the compressed entries, one row per `ratio` tokens, in the block that holds
  the window's last token ([num_blocks, rows_per_block, D], rows_per_block = max(1, block_size // ratio));
- CSA layers: the indexer's compressed keys, laid out like the entries ([..., index_head_dim]).

Per sequence (a state slot, held while the sequence runs): each compressor's open window, the
per-token projections (value and gate logits, float32) of its last `ring` tokens, `ring` = 2 x ratio
with overlapping windows (CSA), else ratio (more with speculative decoding: `ring_size`), token p in
row p % ring of its slot. A ring row holds the token's value then its gate logits, as the compressor's
one projection GEMM gives them, so a decode step stores both with one write. These are rebuilt, not
cached: a prefix hit recomputes the last `prefix_replay_tokens` tokens (bounded replay), whose
sliding-window KV is already paged.

In an FP8 cache (float8_e4m3fn) every paged row carries its token's float32 scale in 4 more bytes
(deepinfer.ops.kv_cache_format); the rings stay float32 (per-sequence state, not per token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model.deepseek_v4.config import CSA, SLIDING, V4Config
from deepinfer.ops.decode_plan import rows_per_block  # the pools' layout, which the decode plan's entry tables follow
from deepinfer.ops.kv_cache_format import row_width

RING_DTYPE = torch.float32


def ring_size(ratio: int, overlap: bool, lookahead: int = 0) -> int:
    """A compressor's ring rows: the tokens an open window (and, with overlap, the one before) pools,
    plus `lookahead` rounded up to whole windows: a speculative verification writes the rows of up to
    that many positions past the last accepted token, which must not land on a row the next step
    still reads. A whole number of windows keeps every window in consecutive rows (row = position %
    ring), which a decode step pools in place (decode_plan)."""
    return (2 * ratio if overlap else ratio) + -(-lookahead // ratio) * ratio


@dataclass
class CompressorCache:
    """One compressor's pool (paged) and ring (per state slot)."""

    ratio: int
    overlap: bool
    pool: torch.Tensor  # [num_blocks, rows_per_block, D]
    projections: torch.Tensor  # [slots, ring, 2W] float32, the ring: a token's value [W] then its gate logits [W], W = 2D with overlap

    @property
    def ring(self) -> int:
        return self.projections.shape[1]

    @property
    def width(self) -> int:
        """W: the projections' width (2D with overlap)."""
        return self.projections.shape[2] // 2

    @property
    def ring_kv(self) -> torch.Tensor:
        return self.projections[..., : self.width]

    @property
    def ring_gate(self) -> torch.Tensor:
        return self.projections[..., self.width :]


@dataclass
class LayerCache:
    swa: torch.Tensor  # [num_blocks, block_size, D]
    compressor: CompressorCache | None = None
    indexer: CompressorCache | None = None


def _compressor(num_blocks, block_size, slots, ratio, overlap, dim, dtype, device, lookahead) -> CompressorCache:
    ring, width = ring_size(ratio, overlap, lookahead), 2 * dim if overlap else dim
    return CompressorCache(
        ratio,
        overlap,
        torch.zeros(num_blocks, rows_per_block(block_size, ratio), row_width(dim, dtype), dtype=dtype, device=device),
        torch.zeros(slots, ring, 2 * width, dtype=RING_DTYPE, device=device),
    )


def allocate(config: V4Config, num_blocks: int, block_size: int, slots: int, dtype: torch.dtype, device, first: int = 0,
             lookahead: int = 0) -> list[LayerCache]:  # fmt: skip
    """The caches of layers first .. num_hidden_layers - 1 (an MTP block: its config's last layer);
    lookahead: the most positions a step writes past a sequence's last accepted token (`ring_size`)."""
    caches = []
    for layer in range(first, config.num_hidden_layers):
        swa = torch.zeros(num_blocks, block_size, row_width(config.head_dim, dtype), dtype=dtype, device=device)
        kind, ratio = config.layer_types[layer], config.compress_ratio(layer)
        if kind == SLIDING:
            caches.append(LayerCache(swa))
            continue
        overlap = kind == CSA
        main = _compressor(num_blocks, block_size, slots, ratio, overlap, config.head_dim, dtype, device, lookahead)
        index = _compressor(num_blocks, block_size, slots, ratio, True, config.index_head_dim, dtype, device, lookahead) if overlap else None
        caches.append(LayerCache(swa, main, index))
    return caches


def block_bytes(config: V4Config, block_size: int, dtype: torch.dtype, first: int = 0) -> int:
    """Bytes one token block takes over layers first.. (the paged caches) in a cache of `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    head, index = row_width(config.head_dim, dtype), row_width(config.index_head_dim, dtype)
    total = 0
    for layer in range(first, config.num_hidden_layers):
        total += block_size * head
        if ratio := config.compress_ratio(layer):
            rows = rows_per_block(block_size, ratio)
            total += rows * head
            if config.layer_types[layer] == CSA:
                total += rows * index
    return total * size


def slot_bytes(config: V4Config, first: int = 0, lookahead: int = 0) -> int:
    """Bytes one state slot takes over layers first.. (the compressors' rings, `ring_size`)."""
    size = torch.empty((), dtype=RING_DTYPE).element_size()
    total = 0
    for layer in range(first, config.num_hidden_layers):
        if ratio := config.compress_ratio(layer):
            if config.layer_types[layer] == CSA:
                total += 2 * ring_size(ratio, True, lookahead) * (2 * config.head_dim + 2 * config.index_head_dim)
            else:
                total += 2 * ring_size(ratio, False, lookahead) * config.head_dim
    return total * size
