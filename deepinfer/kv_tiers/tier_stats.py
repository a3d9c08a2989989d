"""What the engine reports per KV tier: its own counts of the blocks it loaded from and stored to the tier,
beside the tier's own counters (`StoreStats`: what it holds, evictions, expired entries, errors)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from deepinfer.kv_tiers.store import StoreStats


@dataclass
class TierCounters:
    """hit_blocks / hit_bytes: blocks (and their bytes) this engine loaded from the tier into device blocks;
    loads: requests that loaded at least one block from it; stores: blocks this engine wrote to it."""

    hit_blocks: int = 0
    hit_bytes: int = 0
    loads: int = 0
    stores: int = 0

    def report(self, own: StoreStats) -> dict:
        """The engine's counts and the tier's: lookups (hits, misses), what it holds, evictions, expired, errors."""
        return {
            **asdict(self),
            "lookups_hit": own.hits,
            "lookups_missed": own.misses,
            "entries": own.entries,
            "bytes_held": own.bytes_held,
            "evictions": own.evictions,
            "expired": own.expired,
            "errors": own.errors,
            "corrupt": own.corrupt,
            "rejected": own.rejected,
        }
