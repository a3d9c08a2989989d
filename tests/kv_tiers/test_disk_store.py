"""DiskStore: bounded in bytes with LRU eviction, TTL expiry on an injected clock (no sleeps), shared by
store objects and processes, degrading on a full disk, ignoring and cleaning killed writers' temp
files, discarding damaged entries."""

from __future__ import annotations

import errno
import logging
import os
import socket
import subprocess
import sys

import pytest
import torch

from deepinfer.kv_tiers.block_codec import decode, encode
from deepinfer.kv_tiers.disk_store import TEMP_PREFIX, DiskStore
from deepinfer.kv_tiers.keys import KVNamespace
from deepinfer.kv_tiers.store import KVStore

from waits import HANG_S

NS = KVNamespace(model="tiny-v3", config_hash="c0ffee", dtype="bfloat16", kv_cache_dtype="bfloat16", kv_layout_version=1, block_size=16)


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def block(i: int) -> bytes:
    return encode({"kv": torch.full((2, 16, 8), float(i), dtype=torch.bfloat16)}, NS)


SIZE = len(block(0))  # every block() has this size
KEYS = [NS.key(bytes([i]) * 16) for i in range(8)]


def test_bound_by_bytes_with_lru_eviction(tmp_path):
    clock = Clock()
    store = DiskStore(tmp_path, 3 * SIZE, evict_to=1.0, clock=clock)
    assert isinstance(store, KVStore)
    for i in range(3):
        clock.now += 1
        assert store.put(KEYS[i], block(i))
    clock.now += 1
    assert store.get(KEYS[0]) == block(0)  # KEYS[0] is now the most recently used
    clock.now += 1
    assert store.put(KEYS[3], block(3))
    assert [store.contains(k) for k in KEYS[:4]] == [True, False, True, True]
    stats = store.stats()
    assert (stats.evictions, stats.entries, stats.bytes_held, stats.hits, stats.stores) == (1, 3, 3 * SIZE, 1, 4)
    assert not store.put(KEYS[4], bytes(3 * SIZE + 1)) and store.stats().rejected == 1


def test_eviction_goes_below_the_bound_by_evict_to(tmp_path):
    clock = Clock()
    store = DiskStore(tmp_path, 4 * SIZE, evict_to=0.5, clock=clock)
    for i in range(5):
        clock.now += 1
        store.put(KEYS[i], block(i))
    assert [store.contains(k) for k in KEYS[:5]] == [False, False, False, True, True]


def test_ttl_expiry_counts_from_the_write(tmp_path):
    clock = Clock()
    store = DiskStore(tmp_path, 10 * SIZE, ttl_s=60, clock=clock)
    store.put(KEYS[0], block(0))
    store.put(KEYS[1], block(1))
    clock.now += 59
    assert store.get(KEYS[0]) == block(0)  # a hit does not extend the TTL
    clock.now += 2
    assert not store.contains(KEYS[0])
    assert store.get(KEYS[0]) is None
    assert not store.path(KEYS[0]).exists()
    store.scan()  # a scan removes expired entries nobody asked for
    assert not store.path(KEYS[1]).exists()
    stats = store.stats()
    assert (stats.expired, stats.hits, stats.misses, stats.entries) == (2, 1, 1, 0)


def test_a_second_store_object_reads_the_entries(tmp_path):
    DiskStore(tmp_path, 10 * SIZE).put(KEYS[0], block(0))
    other = DiskStore(tmp_path, 10 * SIZE)
    assert other.stats().entries == 1 and other.stats().bytes_held == SIZE
    assert decode(other.get(KEYS[0]), NS)["kv"].eq(0).all()
    assert other.delete(KEYS[0]) and other.get(KEYS[0]) is None


def test_another_process_reads_what_this_one_wrote(tmp_path):
    writer = DiskStore(tmp_path, 10 * SIZE)
    for i in range(3):
        assert writer.put(KEYS[i], block(i))
    reader = (
        "import sys\n"
        "from deepinfer.kv_tiers.disk_store import DiskStore\n"
        "store = DiskStore(sys.argv[1], 1 << 20)\n"
        "for key in sys.argv[2:]:\n"
        "    data = store.get(key)\n"
        "    print('miss' if data is None else data.hex())\n"
    )
    proc = subprocess.run([sys.executable, "-c", reader, str(tmp_path), *KEYS[:4]], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [block(0).hex(), block(1).hex(), block(2).hex(), "miss"]


def test_a_full_disk_degrades_to_false_with_one_log_line(tmp_path, monkeypatch, caplog):
    store = DiskStore(tmp_path, 10 * SIZE)
    store.put(KEYS[0], block(0))

    def full_disk(tmp, value):
        with open(tmp, "wb") as f:  # a partial temp file, as a real write cut short leaves
            f.write(value[:10])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(DiskStore, "_write", staticmethod(full_disk))
    with caplog.at_level(logging.WARNING, logger="deepinfer.kv_tiers.disk_store"):
        assert store.put(KEYS[1], block(1)) is False
        assert store.put(KEYS[2], block(2)) is False
    assert [r.getMessage().count("\n") for r in caplog.records] == [0]  # one line, once
    assert "full" in caplog.records[0].getMessage()
    stats = store.stats()
    assert (stats.errors, stats.stores) == (2, 1)
    assert store.get(KEYS[0]) == block(0) and store.get(KEYS[1]) is None
    assert not [p for p in tmp_path.rglob(f"{TEMP_PREFIX}*")]  # the partial temp files are gone


def test_leftover_temp_files_are_ignored_and_cleaned_on_open(tmp_path):
    store = DiskStore(tmp_path, 10 * SIZE)
    store.put(KEYS[0], block(0))
    shard = store.path(KEYS[0]).parent
    host = socket.gethostname().replace(".", "_")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=HANG_S)
    killed = shard / f"{TEMP_PREFIX}{host}.{dead.pid}.abc123"
    stale = shard / f"{TEMP_PREFIX}otherhost.1.def456"
    live = shard / f"{TEMP_PREFIX}{host}.{os.getpid()}.0a0b0c"  # a writer still running: left alone
    for path in (killed, stale, live):
        path.write_bytes(block(1)[:50])
    os.utime(stale, (0, 0))
    store.scan()
    assert store.stats().entries == 1 and store.stats().bytes_held == SIZE  # temp files are not entries
    reopened = DiskStore(tmp_path, 10 * SIZE)
    assert not killed.exists() and not stale.exists() and live.exists()
    assert reopened.get(KEYS[0]) == block(0) and reopened.stats().entries == 1


def test_a_truncated_file_is_discarded_on_read(tmp_path):
    store = DiskStore(tmp_path, 10 * SIZE)
    store.put(KEYS[0], block(0))
    path = store.path(KEYS[0])
    os.truncate(path, SIZE // 2)
    assert store.get(KEYS[0]) is None
    assert not path.exists()
    stats = store.stats()
    assert (stats.corrupt, stats.misses, stats.hits) == (1, 1, 0)


def test_keys_cannot_leave_the_directory(tmp_path):
    store = DiskStore(tmp_path, 10 * SIZE)
    for bad in ("../etc", "a/b", ".tmp.x", "A" * 3, "x"):
        with pytest.raises(ValueError, match="key"):
            store.put(bad, b"x")


def test_damaged_entries_are_logged_once_per_kind_and_all_counted(tmp_path, caplog):
    """After an upgrade every block of the older format is "another format version": one line, not one a block."""
    import struct

    from deepinfer.kv_tiers import block_codec

    store = DiskStore(tmp_path, 1 << 30)
    keys = [f"{i:02x}" * 8 for i in range(5)]
    good = block_codec.encode({"x": torch.arange(8, dtype=torch.uint8)}, NS)
    for key in keys[:3]:  # an older format version, checksum intact
        body = bytearray(good[: -block_codec.CHECKSUM_BYTES])
        struct.pack_into("<H", body, 8, block_codec.FORMAT_VERSION - 1)
        store.put(key, bytes(body) + block_codec._checksum(bytes(body)))
    for key in keys[3:]:  # truncated
        store.put(key, good[:-7])
    with caplog.at_level(logging.WARNING, logger="deepinfer.kv_tiers.disk_store"):
        assert all(store.get(k) is None for k in keys)
    assert store.stats().corrupt == 5
    assert len(caplog.records) == 2 and "version" in caplog.records[0].getMessage()


def test_get_into_reads_the_payload_into_the_row_and_checks_it(tmp_path, caplog):
    """The tiers' read: payload straight into the caller's row. A damaged, truncated, foreign-layout or expired entry
    leaves no hit (each damaged one removed and counted as `get` counts it); an intact one equals `get`'s payload."""
    from deepinfer.kv_tiers import block_codec

    clock = Clock()
    store = DiskStore(tmp_path, 1 << 30, ttl_s=100.0, clock=clock)
    layout = [("kv", "bfloat16", (2, 16, 8))]
    head = block_codec.head(NS, layout)
    row = torch.zeros(SIZE - len(head) - block_codec.CHECKSUM_BYTES, dtype=torch.uint8)
    for i in range(4):
        store.put(KEYS[i], block(i))
    assert store.get_into(KEYS[0], head, row.numpy())
    assert torch.equal(row.view(torch.bfloat16).view(2, 16, 8), decode(block(0), NS)["kv"])
    payload_start = len(head)
    with open(store.path(KEYS[1]), "r+b") as f:  # one payload byte flipped: the checksum fails
        f.seek(payload_start + 5)
        byte = f.read(1)
        f.seek(payload_start + 5)
        f.write(bytes([byte[0] ^ 1]))
    os.truncate(store.path(KEYS[2]), SIZE - 3)
    other = block_codec.encode({"kw": torch.zeros(2, 16, 8, dtype=torch.bfloat16)}, NS)
    store.put(KEYS[3], other)  # intact, of the same size, another layout (another tensor name)
    assert len(other) == SIZE
    with caplog.at_level(logging.WARNING, logger="deepinfer.kv_tiers.disk_store"):
        assert not any(store.get_into(k, head, row.numpy()) for k in KEYS[1:4])
    assert not any(store.path(k).exists() for k in KEYS[1:4])
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert "checksum does not match" in messages and "truncated" in messages and "not the reader's layout" in messages
    store.put(KEYS[4], block(4))
    clock.now += 101
    assert not store.get_into(KEYS[4], head, row.numpy()) and not store.get_into(KEYS[5], head, row.numpy())
    stats = store.stats()
    assert (stats.hits, stats.corrupt, stats.expired, stats.misses) == (1, 3, 1, 5)
