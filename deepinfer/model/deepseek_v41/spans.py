"""What a V4.1 step's layers need to know of each sequence, and the cross-layer CSA2 state handed between them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def rotate_tail(ops, x: torch.Tensor, rope_dim: int, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with its last rope_dim channels rotated (DeepSeek's interleaved pairs), as a new tensor."""
    out = x.clone()
    out[..., x.shape[-1] - rope_dim :] = ops.rope(x[..., x.shape[-1] - rope_dim :].contiguous(), positions, table, interleaved=True)
    return out
