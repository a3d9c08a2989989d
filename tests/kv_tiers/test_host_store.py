"""HostStore: bounded in bytes, least recently used first, thread-safe."""

from __future__ import annotations

import threading

from deepinfer.kv_tiers.host_store import HostStore
from deepinfer.kv_tiers.store import KVStore


def test_lru_eviction_by_bytes():
    store = HostStore(300)
    assert isinstance(store, KVStore)
    for key in ("aa", "bb", "cc"):
        assert store.put(key, bytes(100))
    assert store.get("aa") == bytes(100)  # aa is now the most recent
    assert store.put("dd", bytes(100))
    assert not store.contains("bb") and store.contains("aa") and store.contains("cc") and store.contains("dd")
    assert store.put("ee", bytes(250))  # needs three of the four entries gone: cc, aa, dd in that order
    assert [k for k in ("aa", "cc", "dd", "ee") if store.contains(k)] == ["ee"]
    stats = store.stats()
    assert (stats.evictions, stats.entries, stats.bytes_held, stats.hits, stats.stores) == (4, 1, 250, 1, 5)


def test_too_large_replace_delete_and_misses():
    store = HostStore(100)
    assert not store.put("aa", bytes(101)) and store.stats().rejected == 1
    assert store.put("aa", bytes(60)) and store.put("aa", bytes(90))  # a replacement does not count twice
    assert store.stats().bytes_held == 90 and store.stats().evictions == 0
    assert store.get("zz") is None and store.stats().misses == 1
    assert store.delete("aa") and not store.delete("aa") and store.stats().bytes_held == 0


def test_threads_keep_the_bound_and_the_books():
    store = HostStore(10_000)

    def work(t: int) -> None:
        for i in range(500):
            key = f"k{t}-{i % 40}"
            store.put(key, bytes(100 + t))
            store.get(f"k{(t + 1) % 8}-{i % 40}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stats = store.stats()
    assert stats.bytes_held <= 10_000
    assert stats.bytes_held == sum(len(v) for v in store._entries.values()) and stats.entries == len(store._entries)
    assert stats.hits + stats.misses == 8 * 500 and stats.stores == 8 * 500
