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


@dataclass
class TierTiming:
    """Where the engine thread spent time on the tiers (the evidence that steps do not wait for tier copies):
    engine_s in the tiers' calls on the step path (offloads, polls, admission checks: launches and bookkeeping; on
    the CPU, where copies are synchronous, the copies too), of which stalled_s (stalls of them) blocked on a copy (the
    bound on copies out in flight, an abort mid-copy); idle_s blocked in `wait`, which the engine calls only when
    nothing else can run (every waiting request is loading its prefix)."""

    engine_s: float = 0.0
    stalled_s: float = 0.0
    stalls: int = 0
    idle_s: float = 0.0

    def report(self) -> dict:
        return asdict(self)
