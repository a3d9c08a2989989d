"""Snapshots of a sequence's state slot at token-block boundaries: what a prefix hit restores besides the shared blocks.

A model whose per-sequence state is not all paged (DeepSeek-V4.1: the window rings, Engram's last ids) cannot resume
a prefix hit from the blocks alone. As vLLM's prefix caching of hybrid models ("align" mode: chunks end on block
boundaries, the state is kept per block) and SGLang's MambaRadixCache do, the engine copies a sequence's slot when
a step leaves it exactly at a block boundary, files the copy under the chained hash of the block it ends
(`Sequence.block_hash`), and a later sequence whose cached prefix ends at that block gets the copy in its own slot
and continues from the boundary: nothing before it is computed again.

The pool holds a fixed number of snapshots (the engine sizes it from its memory budget, `snapshot_capacity`); when
it is full the least recently used one is overwritten. A snapshot is plain tensor copies of every slot tensor the
model names (`prefix_state_tensors`), ordered on the device after the step that computed the state.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

SNAPSHOT_SHARE = 10  # snapshots take about 1/SNAPSHOT_SHARE of the bytes the blocks take (`snapshot_capacity`)


def snapshot_capacity(num_blocks: int, block_bytes: int, snapshot_bytes: int, max_num_seqs: int) -> int:
    """How many snapshots the engine keeps: a tenth of the blocks' bytes, but never fewer than one per running
    sequence (each keeps its newest boundary) nor more than the blocks (a snapshot is only reached through its block)."""
    return min(num_blocks, max(max_num_seqs, num_blocks * block_bytes // SNAPSHOT_SHARE // max(1, snapshot_bytes)))


class StateSnapshots:
    def __init__(self, slot_tensors: list[torch.Tensor], capacity: int):
        """slot_tensors: the model's per-sequence state, dim 0 the state slot; capacity: snapshots kept (>= 1)."""
        if capacity < 1:
            raise ValueError(f"a snapshot pool needs room for at least one snapshot, got {capacity}")
        self.slot_tensors = slot_tensors
        self.pool = [torch.zeros((capacity, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in slot_tensors]
        self.filed: OrderedDict[bytes, int] = OrderedDict()  # block hash -> pool entry, least recently used first
        self.free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest

    @property
    def capacity(self) -> int:
        return self.pool[0].shape[0] if self.pool else 0

    @staticmethod
    def bytes_per_snapshot(slot_tensors: list[torch.Tensor]) -> int:
        return sum(t[0].numel() * t.element_size() for t in slot_tensors)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.filed

    def __len__(self) -> int:
        return len(self.filed)

    def capture(self, slot: int) -> int:
        """Copy slot's state into a pool entry not filed yet (`file` or `release` it); evicts the least recently used."""
        entry = self.take()
        for pool, tensor in zip(self.pool, self.slot_tensors):
            pool[entry].copy_(tensor[slot])
        return entry

    def file(self, block_hash: bytes, entry: int) -> None:
        """File a captured entry under the hash of the block it ends (an equal state already filed is kept instead)."""
        if block_hash in self.filed:
            self.filed.move_to_end(block_hash)
            self.release(entry)
        else:
            self.filed[block_hash] = entry

    def save(self, block_hash: bytes, slot: int) -> None:
        """Capture slot's state and file it under block_hash (nothing copied when a snapshot of that block exists)."""
        if block_hash in self.filed:
            self.filed.move_to_end(block_hash)
        else:
            self.filed[block_hash] = self.capture(slot)

    def take(self) -> int:
        """A pool entry not filed yet, for a snapshot copied in from elsewhere (a KV tier): `file` or `release` it."""
        return self.free.pop() if self.free else self.filed.popitem(last=False)[1]

    def entry(self, block_hash: bytes) -> int | None:
        """The pool entry filed under block_hash, or None (not a use: the LRU order stays)."""
        return self.filed.get(block_hash)

    def release(self, entry: int) -> None:
        self.free.append(entry)

    def restore(self, block_hash: bytes, slot: int) -> None:
        """Copy the snapshot filed under block_hash into slot (a KeyError when there is none)."""
        entry = self.filed[block_hash]
        self.filed.move_to_end(block_hash)
        for pool, tensor in zip(self.pool, self.slot_tensors):
            tensor[slot].copy_(pool[entry])

    def drop(self, block_hash: bytes) -> None:
        """Forget the snapshot of a block whose content is gone (its block was handed out again)."""
        entry = self.filed.pop(block_hash, None)
        if entry is not None:
            self.free.append(entry)

    def clear(self) -> None:
        for block_hash in list(self.filed):
            self.drop(block_hash)
