"""The host-memory tier: blocks as raw rows in one pinned buffer, bounded in bytes, least recently used first out.

Unlike the stores (`KVStore`: encoded, checksummed bytes that may outlive the process), the host tier lives
and dies with the engine, so it keeps a block exactly as the device holds it: one row of `BlockRows.block_bytes`
in a pinned [capacity, block_bytes] buffer, which the device copies into and out of asynchronously (DMA from
pinned memory), with no encoding on either path. An entry is `pending` from the moment its copy from the
device is queued until that copy has completed (`complete`): it is neither found nor evicted meanwhile.
An entry a load is reading is `held` and is not evicted until released. Engine thread only (no lock).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from deepinfer.kv_tiers.store import StoreStats


class HostTier:
    def __init__(self, capacity_bytes: int, block_bytes: int, pinned: bool):
        """pinned: page-locked memory (where the device runs asynchronously; an accelerator's torch build is needed)."""
        if block_bytes < 1:
            raise ValueError(f"a host tier needs block_bytes >= 1, got {block_bytes}")
        self.capacity = int(capacity_bytes) // block_bytes
        if self.capacity < 1:
            raise ValueError(f"kv_offload_cpu_gib holds no block: {capacity_bytes} bytes < one block of {block_bytes} bytes; give it more")
        self.block_bytes = block_bytes
        self.rows = torch.empty((self.capacity, block_bytes), dtype=torch.uint8, pin_memory=pinned)
        self.entries: OrderedDict[str, int] = OrderedDict()  # key -> row, least recently used first (complete ones only)
        self.pending: dict[str, int] = {}  # key -> row whose copy from the device is in flight
        self.held: dict[int, int] = {}  # row -> loads reading it
        self.free = list(range(self.capacity - 1, -1, -1))
        self.stats = StoreStats()

    def __contains__(self, key: str) -> bool:
        return key in self.entries or key in self.pending

    def find(self, key: str) -> int | None:
        """The row holding `key` (marked as recently used, counted as a hit), or None (a miss)."""
        row = self.entries.get(key)
        if row is None:
            self.stats.misses += 1
            return None
        self.entries.move_to_end(key)
        self.stats.hits += 1
        return row

    def reserve(self, key: str) -> int | None:
        """A row for `key`'s copy from the device (pending until `complete`), evicting the least recently used
        entry not being read; None when every row is pending or held (the block is not kept)."""
        if self.free:
            row = self.free.pop()
        else:
            victim = next((k for k, r in self.entries.items() if r not in self.held), None)
            if victim is None:
                self.stats.rejected += 1
                return None
            row = self.entries.pop(victim)
            self.stats.evictions += 1
        self.pending[key] = row
        return row

    def complete(self, key: str) -> None:
        """The copy into `key`'s row has completed: the entry can be found."""
        self.entries[key] = self.pending.pop(key)
        self.stats.stores += 1
        self.stats.bytes_stored += self.block_bytes

    def hold(self, row: int) -> None:
        self.held[row] = self.held.get(row, 0) + 1

    def release(self, row: int) -> None:
        left = self.held.pop(row) - 1
        if left:
            self.held[row] = left

    def snapshot(self) -> StoreStats:
        from dataclasses import replace

        return replace(self.stats, entries=len(self.entries), bytes_held=len(self.entries) * self.block_bytes)
