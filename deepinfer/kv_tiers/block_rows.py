"""One token block's rows across every paged cache tensor of a model, as one flat byte row.

A model's paged caches are several tensors whose dim 0 is the block id (DeepSeek V2/V3: one latent
cache per layer; V4: per layer the sliding window's rows, and the compressed entries and indexer keys of
the compressing layers; the MTP layer's cache when speculative decoding runs). A tier keeps a block as
the concatenation of its rows in every tensor, as bytes: `gather` and `scatter` move many blocks at once
with one kernel per tensor (not one per block and tensor), `split` turns a flat row into named tensors for
the block codec, whose payload is that row again (`block_codec.decode_row` copies it back in one piece).
"""

from __future__ import annotations

import torch


class BlockRows:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        """tensors: name -> a paged cache tensor [num_blocks (+ scratch), ...], contiguous, all on one device."""
        if not tensors:
            raise ValueError("BlockRows needs at least one paged cache tensor")
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise ValueError(f"the paged cache tensors lie on several devices: {sorted(map(str, devices))}")
        for name, t in tensors.items():
            if not t.is_contiguous() or t.dim() < 2:
                raise ValueError(f"paged cache tensor {name!r} must be contiguous with a block dimension first, got {tuple(t.shape)}")
        self.tensors = tensors
        self.device = next(iter(devices))
        self.row_bytes = {name: t[0].numel() * t.element_size() for name, t in tensors.items()}
        self.block_bytes = sum(self.row_bytes.values())

    def layout(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, one block's shape) of every tensor: what a stored block's bytes mean (part of the tiers' namespace)."""
        return [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape[1:])) for name, t in self.tensors.items()]

    def gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        """[n, block_bytes] uint8 on the cache's device: the rows of blocks `block_ids` (a tensor on that device),
        in the order given, read through byte views of the caches (any dtype, fp8 too). Queued on the current stream
        (it reads the blocks as that stream left them)."""
        parts = [t.view(torch.uint8).index_select(0, block_ids).view(len(block_ids), -1) for t in self.tensors.values()]
        return torch.cat(parts, dim=1)

    def scatter(self, block_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write `rows` ([n, block_bytes] uint8 on the cache's device) into blocks `block_ids`, on the current stream.
        Through byte views of the caches, as `gather` reads them: torch has no index_copy_ for fp8 on the CPU."""
        at = 0
        for name, t in self.tensors.items():
            width = self.row_bytes[name]
            raw = t.view(torch.uint8)
            raw.index_copy_(0, block_ids, rows[:, at : at + width].contiguous().view(len(block_ids), *raw.shape[1:]))
            at += width

    def split(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """One flat row ([block_bytes] uint8) as its named tensors (views, no copy): what the block codec stores."""
        out, at = {}, 0
        for name, t in self.tensors.items():
            width = self.row_bytes[name]
            out[name] = row[at : at + width].view(t.dtype).view(t.shape[1:])
            at += width
        return out
