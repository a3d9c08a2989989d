"""A KV store in a directory: bounded in bytes, a TTL per entry, least recently used first within it;
crash-safe and shared by several processes.

Layout: `<root>/<key[:2]>/<key>.kvb`, one file per entry holding the block's bytes (`block_codec`).

- **Writes are atomic.** A put writes `<root>/<key[:2]>/.tmp.<host>.<pid>.<random>`, fsyncs it, stamps
  its times, then `os.replace`s it onto the entry's name. A reader opens only entry names, so it sees
  the old file, the new one or none, never half of one; a writer killed mid-put leaves only a temp file.
  The directory itself is not fsynced: a crash may lose the newest entries, which a cache may.
- **Times live in the file's own timestamps, no sidecar.** mtime = when the entry was written (the TTL
  counts from it: a hit does not extend it); atime = its last use (set explicitly on a hit, so `noatime`
  and `relatime` mounts do not matter). The store's clock is injectable (`clock`), tests never sleep.
- **The bound.** Each store object keeps an estimate of the bytes held: the last scan of the directory
  plus its own writes since. When a put takes the estimate past `capacity_bytes`, the store scans the
  directory (every process's entries), removes expired entries, then the least recently used until
  the total is at most `evict_to` x capacity (below 1 so that a full store does not scan on every put).
  Writers in several processes each see their own writes between scans, so the directory may exceed
  the capacity by what the others wrote since this one's last scan.
- **Failures degrade.** A full disk (ENOSPC), a permission or an I/O error: `put` returns False, `get`
  misses, the error is counted and logged once per kind (one line), nothing raises. An entry that fails
  `verify` (by default `block_codec.verify`: truncated, damaged) is removed and counted as corrupt.
- **Leftover temp files** (a killed writer's) are never read and never counted; opening a store
  removes those whose writer is gone (same host, no such process) or that are older than `stale_temp_s`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable
from urllib.parse import unquote, urlsplit

from deepinfer.kv_tiers.block_codec import CHECKSUM_BYTES, CorruptBlock, payload_checked
from deepinfer.kv_tiers.block_codec import verify as verify_block
from deepinfer.kv_tiers.store import FirstOfKind, StoreStats, check_key

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
TEMP_PREFIX = ".tmp."


def _writer_gone(name: str, host: str) -> bool:
    """Whether the temp file `name` (.tmp.<host>.<pid>.<random>) was written by a process of this host that no longer runs."""
    parts = name[len(TEMP_PREFIX) :].rsplit(".", 2)
    if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: it runs, as another user
        return False
    return False


class DiskStore:
    """`root`: the directory (created if missing). `capacity_bytes`: the most bytes of entries held.
    `ttl_s`: an entry's lifetime from its write (None: no expiry). `evict_to`: the fraction of the
    capacity an over-full store evicts down to. `verify`: checks the bytes read (raises CorruptBlock;
    None: no check). `clock`: seconds since the epoch (time.time). `stale_temp_s`: a temp file this old
    is a dead writer's whatever its name says."""

    def __init__(
        self,
        root: str | os.PathLike,
        capacity_bytes: int,
        *,
        ttl_s: float | None = None,
        evict_to: float = 0.9,
        verify: Callable[[bytes], None] | None = verify_block,
        clock: Callable[[], float] = time.time,
        stale_temp_s: float = 600.0,
    ):
        if capacity_bytes < 1:
            raise ValueError(f"a disk KV store needs capacity_bytes >= 1, got {capacity_bytes}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"a disk KV store's ttl_s must be positive (or None: no expiry), got {ttl_s}")
        if not 0.0 < evict_to <= 1.0:
            raise ValueError(f"a disk KV store's evict_to is a fraction of its capacity in (0, 1], got {evict_to}")
        self.root = Path(root)
        self.capacity_bytes = int(capacity_bytes)
        self.ttl_s = ttl_s
        self.evict_to = evict_to
        self.stale_temp_s = stale_temp_s
        self._verify = verify
        self._clock = clock
        self._host = socket.gethostname().replace(".", "_") or "host"
        self._lock = threading.Lock()
        self._logged = FirstOfKind()  # what was logged once
        self._stats = StoreStats()
        self.root.mkdir(parents=True, exist_ok=True)
        self._clean_temp_files()
        self.scan()

    def __repr__(self) -> str:
        return f"DiskStore({str(self.root)!r}, capacity_bytes={self.capacity_bytes}, ttl_s={self.ttl_s})"

    def path(self, key: str) -> Path:
        """Where the entry of `key` lives."""
        return self.root / key[:2] / f"{key}{SUFFIX}"

    # --- the protocol ---

    def get(self, key: str) -> bytes | None:
        path = self.path(check_key(key))
        now = self._clock()
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if self._expired(st.st_mtime, now):
                    self._remove(path, expired=1)
                    return self._miss()
                data = f.read()
        except FileNotFoundError:
            return self._miss()
        except OSError as e:
            self._error(e, f"reading {path}")
            return self._miss()
        if not self._verified(path, data):
            return self._miss()
        self._hit(path, now, st)
        return data

    def get_into(self, key: str, head: bytes, out) -> bool:
        """`get` for a reader that knows what an entry of its layout starts with (`head`: `block_codec.head`) and where
        its payload goes (`out`: a writable buffer of the payload's size, a pinned row): the payload read straight into
        `out` (no intermediate bytes, one checksum pass over it). An entry that does not start with `head` or is not of
        that size is read whole and checked as `get` checks it (a damaged one removed and counted), and misses. Whether
        `out` now holds the entry's payload (checked)."""
        path = self.path(check_key(key))
        now = self._clock()
        out = memoryview(out).cast("B")
        size = len(head) + len(out) + CHECKSUM_BYTES
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return self._missed()
        except OSError as e:
            self._error(e, f"reading {path}")
            return self._missed()
        try:
            st = os.fstat(fd)
            if self._expired(st.st_mtime, now):
                self._remove(path, expired=1)
                return self._missed()
            got, tail = bytearray(len(head)), bytearray(CHECKSUM_BYTES)
            if st.st_size == size and os.readv(fd, [got, out, tail]) == size and got == head:
                if payload_checked(got, out, tail):
                    self._hit(path, now, st)
                    return True
            # another size or header, or the right ones damaged: read whole, for `verify`'s reason
            os.lseek(fd, 0, os.SEEK_SET)
            data = b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
        except OSError as e:
            self._error(e, f"reading {path}")
            return self._missed()
        finally:
            os.close(fd)
        if self._verified(path, data):  # whole and undamaged, of another layout: what this reader cannot use
            self._corrupt(path, CorruptBlock("an entry whose header is not the reader's layout", "layout"))
        return self._missed()

    def put(self, key: str, value: bytes) -> bool:
        path = self.path(check_key(key))
        size = len(value)
        if size > self.capacity_bytes:
            with self._lock:
                self._stats.rejected += 1
            return False
        tmp = path.parent / f"{TEMP_PREFIX}{self._host}.{os.getpid()}.{secrets.token_hex(6)}"
        try:
            path.parent.mkdir(exist_ok=True)
            self._write(tmp, value)
            now = self._clock()
            os.utime(tmp, (now, now))
            os.replace(tmp, path)
        except OSError as e:
            self._error(e, f"writing {path}")
            with contextlib.suppress(OSError):  # the temp file may never have been created
                tmp.unlink()
            return False
        with self._lock:
            self._stats.stores += 1
            self._stats.bytes_stored += size
            self._stats.entries += 1
            self._stats.bytes_held += size
            over = self._stats.bytes_held > self.capacity_bytes
        if over:
            self.scan(evict=True)
        return True

    def contains(self, key: str) -> bool:
        try:
            st = os.stat(self.path(check_key(key)))
        except OSError:
            return False
        return not self._expired(st.st_mtime, self._clock())

    def delete(self, key: str) -> bool:
        path = self.path(check_key(key))
        try:
            size = path.stat().st_size
        except OSError:
            return False
        if not self._remove(path):
            return False
        with self._lock:
            self._stats.entries = max(0, self._stats.entries - 1)
            self._stats.bytes_held = max(0, self._stats.bytes_held - size)
        return True

    def stats(self) -> StoreStats:
        with self._lock:
            return replace(self._stats)

    # --- the directory as a whole ---

    def scan(self, evict: bool = False) -> None:
        """Count what the directory holds (every process's entries), removing expired ones; with `evict`,
        and if over the capacity, remove the least recently used down to `evict_to` x capacity."""
        now = self._clock()
        live: list[tuple[float, int, Path]] = []  # (last use, size, path)
        for path in self._entry_files():
            try:
                st = path.stat()
            except OSError:
                continue  # removed by another process meanwhile
            if self._expired(st.st_mtime, now):
                self._remove(path, expired=1)
            else:
                live.append((st.st_atime, st.st_size, path))
        total = sum(size for _, size, _ in live)
        if evict and total > self.capacity_bytes:
            target = self.evict_to * self.capacity_bytes
            live.sort(key=lambda entry: entry[0])
            while live and total > target:
                _, size, path = live.pop(0)
                self._remove(path, evictions=1)  # False: another process removed it first; gone either way
                total -= size
        with self._lock:
            self._stats.entries = len(live)
            self._stats.bytes_held = total

    def _files(self):
        """(shard folder, file name) of every file in the shard folders; a folder that cannot be listed is skipped."""
        try:
            shards = [d for d in self.root.iterdir() if d.is_dir()]
        except OSError as e:
            self._error(e, f"listing {self.root}")
            return
        for shard in shards:
            try:
                names = os.listdir(shard)
            except OSError:
                continue
            for name in names:
                yield shard, name

    def _entry_files(self):
        for shard, name in self._files():
            if name.endswith(SUFFIX) and not name.startswith("."):
                yield shard / name

    def _clean_temp_files(self) -> None:
        now = time.time()  # temp files carry the file system's times, not the store's clock
        for shard, name in self._files():
            if name.startswith(TEMP_PREFIX):
                path = shard / name
                try:
                    if _writer_gone(name, self._host) or now - path.stat().st_mtime > self.stale_temp_s:
                        path.unlink()
                        logger.info("disk KV store %s: removed a killed writer's temp file %s", self.root, name)
                except OSError:
                    continue  # renamed or removed meanwhile

    # --- helpers ---

    def _expired(self, written: float, now: float) -> bool:
        return self.ttl_s is not None and now - written > self.ttl_s

    @staticmethod
    def _write(tmp: Path, value: bytes) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(value)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def _remove(self, path: Path, *, expired: int = 0, corrupt: int = 0, evictions: int = 0) -> bool:
        """Remove an entry and count why; False if another process removed it first."""
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as e:
            self._error(e, f"removing {path}")
            return False
        with self._lock:
            self._stats.expired += expired
            self._stats.corrupt += corrupt
            self._stats.evictions += evictions
        return True

    def _verified(self, path: Path, data: bytes) -> bool:
        """Whether `data` (an entry's bytes) passes `verify`; a damaged entry is removed, counted and logged once per kind."""
        if self._verify is not None:
            try:
                self._verify(data)
            except CorruptBlock as e:
                self._corrupt(path, e)
                return False
        return True

    def _corrupt(self, path: Path, e: CorruptBlock) -> None:
        if self._logged.first(("corrupt", e.reason)):
            why = "logged once per kind, the rest counted as corrupt"
            logger.warning("disk KV store %s: removed a damaged entry %s (%s; %s)", self.root, path.name, e, why)
        self._remove(path, corrupt=1)

    def _hit(self, path: Path, now: float, st: os.stat_result) -> None:
        """Count a hit and record the use (atime, for LRU; mtime, the TTL's start, kept)."""
        try:
            os.utime(path, (now, st.st_mtime))
        except OSError:
            pass  # removed meanwhile, or another user's file: the use goes unrecorded, the data is fine
        with self._lock:
            self._stats.hits += 1

    def _miss(self) -> None:
        with self._lock:
            self._stats.misses += 1
        return None

    def _missed(self) -> bool:
        self._miss()
        return False

    def _error(self, e: OSError, doing: str) -> None:
        with self._lock:
            self._stats.errors += 1
        if self._logged.first(("errno", e.errno)):
            why = "the disk is full; puts fail (and are counted) until space frees" if e.errno == errno.ENOSPC else "counted; the store goes on"
            logger.warning("disk KV store %s: %s: %s (%s; logged once per kind)", self.root, doing, e.strerror or e, why)


def open_url(url: str, **options) -> DiskStore:
    """The "file" entry point of "deepinfer.kv_stores": `file:///path?size=100GiB&ttl_s=3600` (size and ttl_s
    also as keyword arguments, capacity_bytes= for size; the other DiskStore arguments as keyword arguments only)."""
    from deepinfer.kv_tiers.open_store import url_options

    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or not parts.path:
        raise ValueError(f"{url!r}: a disk KV store is file:///absolute/path (three slashes; a local directory)")
    merged = url_options(url, options, ("capacity_bytes", "ttl_s", "evict_to", "stale_temp_s"))
    if "capacity_bytes" not in merged:
        raise ValueError(f"{url!r}: a disk KV store needs a size: file:///path?size=100GiB or capacity_bytes=")
    for name in ("ttl_s", "evict_to", "stale_temp_s"):
        if isinstance(merged.get(name), str):
            merged[name] = float(merged[name])
    return DiskStore(unquote(parts.path), **merged)
