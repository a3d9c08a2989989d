"""A KV store in host memory: bounded in bytes, least recently used entries evicted first, thread-safe.

One `OrderedDict` (oldest use first) under one lock; `get` moves an entry to the back. Entries live as
long as the process and as the capacity allows: no TTL (nothing outlives the process to go stale).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace
from urllib.parse import urlsplit

from deepinfer.kv_tiers.store import StoreStats, check_key


class HostStore:
    """`capacity_bytes`: the most bytes of values held at once (keys and bookkeeping not counted)."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 1:
            raise ValueError(f"a host KV store needs capacity_bytes >= 1, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._held = 0
        self._stats = StoreStats()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"HostStore(capacity_bytes={self.capacity_bytes}, entries={len(self._entries)}, bytes_held={self._held})"

    def get(self, key: str) -> bytes | None:
        check_key(key)
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self._stats.hits += 1
            return value

    def put(self, key: str, value: bytes) -> bool:
        check_key(key)
        value = bytes(value)
        with self._lock:
            if len(value) > self.capacity_bytes:
                self._stats.rejected += 1
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self._held -= len(old)
            while self._held + len(value) > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._held -= len(evicted)
                self._stats.evictions += 1
            self._entries[key] = value
            self._held += len(value)
            self._stats.stores += 1
            self._stats.bytes_stored += len(value)
            return True

    def contains(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return key in self._entries

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is None:
                return False
            self._held -= len(old)
            return True

    def stats(self) -> StoreStats:
        with self._lock:
            return replace(self._stats, entries=len(self._entries), bytes_held=self._held)


def open_url(url: str, **options) -> HostStore:
    """The "host" entry point of "deepinfer.kv_stores": `host://16GiB`, `host://?size=16GiB` or `host://` with capacity_bytes=."""
    from deepinfer.kv_tiers.open_store import parse_size, url_options

    merged = url_options(url, options, ("capacity_bytes",))
    netloc = urlsplit(url).netloc
    if netloc and "capacity_bytes" not in merged:
        merged["capacity_bytes"] = parse_size(netloc)
    if "capacity_bytes" not in merged:
        raise ValueError(f"{url!r}: a host KV store needs a size: host://16GiB, host://?size=16GiB or capacity_bytes=")
    return HostStore(**merged)
