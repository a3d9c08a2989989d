"""The interface every KV store keeps (`KVStore`) and the counters it reports (`StoreStats`).

A store maps a key (`KVNamespace.key`: lowercase hex) to the bytes of one block (`block_codec.encode`).
It is a cache: `put` may refuse or a later `get` may miss (evicted, expired, damaged), and neither is
an error to the caller. No store method raises for a full disk, a lost file or a damaged entry: each
returns a miss / False and counts it. A key holds the same bytes wherever it is written (the key
names its content), so two writers of one key never disagree about its value.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

KEY_PATTERN = re.compile(r"[0-9a-z_-]{2,200}")


def check_key(key: str) -> str:
    """`key` if it is a valid store key (2 to 200 of [0-9a-z_-]: safe as a file name); ValueError otherwise."""
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise ValueError(f"a KV store key is 2 to 200 characters of [0-9a-z_-] (KVNamespace.key gives one), got {key!r}")
    return key


@dataclass
class FirstOfKind:
    """The kinds of trouble a store has logged (an errno, a refused command's kind, a damaged entry's
    `CorruptBlock.reason`...): the first of each kind is logged, the rest only counted, so that a full disk or a
    directory of blocks an older format wrote logs one line, not one a call. Thread-safe."""

    _seen: set = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def first(self, kind) -> bool:
        """Whether `kind` (hashable) is seen for the first time."""
        with self._lock:
            new = kind not in self._seen
            self._seen.add(kind)
        return new


@dataclass
class StoreStats:
    """A store's counters since it was opened, as this store object saw them (another process using the
    same directory keeps its own), and what it holds now.

    hits / misses: `get`s answered / not (absent, expired, damaged, unreadable).
    stores: `put`s that stored the bytes; bytes_stored: their total size.
    rejected: `put`s refused because the value alone exceeds the store's capacity.
    evictions: entries removed to stay within the capacity (least recently used first).
    expired: entries removed because they outlived the store's TTL.
    corrupt: entries found damaged on read (`block_codec.CorruptBlock`) and removed.
    errors: operating-system errors (a full disk, a permission, an I/O error), each turned into a miss or a False;
        for a server's store, calls the server did not answer or refused, and calls skipped while it backs off.
    entries / bytes_held: what the store holds now (for a directory: at its last scan plus its own writes since).

    A shared server's store (`redis_store`) counts what its client sees: the server evicts (maxmemory) and
    expires entries unseen, so evictions / expired stay 0 there, and so do entries / bytes_held (the server
    holds every client's entries).
    """

    hits: int = 0
    misses: int = 0
    stores: int = 0
    bytes_stored: int = 0
    rejected: int = 0
    evictions: int = 0
    expired: int = 0
    corrupt: int = 0
    errors: int = 0
    entries: int = 0
    bytes_held: int = 0


@runtime_checkable
class KVStore(Protocol):
    """A bounded map from store keys to one block's bytes. Safe to call from several threads. A store may also offer
    `get_into(key, head, out) -> bool` (`DiskStore.get_into`): the payload read straight into the caller's row; the
    tiers use it where it is there, `get` elsewhere."""

    def get(self, key: str) -> bytes | None:
        """The bytes stored under `key`, or None (a miss); marks the entry as recently used."""
        ...

    def put(self, key: str, value: bytes) -> bool:
        """Store `value` under `key` (replacing what was there), evicting least recently used entries as
        needed; False if it was not stored (too large, or the medium failed: counted, never raised)."""
        ...

    def contains(self, key: str) -> bool:
        """Whether an unexpired entry of `key` is there now (a `get` may still find it damaged); not a use, not counted."""
        ...

    def delete(self, key: str) -> bool:
        """Remove `key`; whether it was there."""
        ...

    def stats(self) -> StoreStats:
        """A snapshot of the counters (a copy: later operations do not change it)."""
        ...
