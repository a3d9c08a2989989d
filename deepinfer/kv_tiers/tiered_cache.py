"""The tiers behind the device prefix cache: what the engine calls to offload blocks and to load a prefix back.

Offload. When a cached block's last user leaves it (`BlockManager.free`), it becomes evictable, and it is
copied out then, before anything can evict it: its rows are gathered on the engine's stream into one device
buffer (one kernel per cache tensor, for every block freed at once), then copied to the host tier's pinned
rows on a stream of their own; the engine's stream never waits for that copy (the gather has read the blocks
before any later step writes them, in stream order). Once the copy has completed (`poll` sees its event), the
host tier finds the block, and a writer thread encodes it (`block_codec`: checksum, namespace) and writes it
to each store (disk, shared store) that does not hold it yet.

Load. A waiting request whose next blocks, past its device prefix hit, are in a tier is held back from
admission (`admissible` False; later requests go ahead) while its blocks are found: first in the host tier
(on the engine thread: a dict lookup), then in the stores by a reader thread, one fetch at a time in request
order, which spreads the blocks over READ_THREADS threads (file reads, checksums and decoding release the GIL)
that read, check and decode them into pinned rows; a read never queues behind store writes, only behind the
writes of its own blocks still in flight. Then device blocks are taken, the rows are copied in and
scattered on a load stream, and once that has completed the blocks join the device prefix cache under their
chain hashes, held for the request, which is admitted as any prefix hit (its blocks count in
`num_cached_tokens`). No step waits for a load: `poll` only looks at what has completed; the engine blocks
(`wait`) only when nothing else can run.

A model whose prefix hits restore a state snapshot (DeepSeek-V4.1: `StateSnapshots`) has its snapshots travel
the same way: a snapshot is copied out when it is filed under its block's hash (its own host rows, its own store
key: the block's key + "-state"), and a load reaches only as far as the last of its blocks whose snapshot some tier,
or the device's pool, holds; that snapshot is copied into the pool and filed before the request is admitted.

On the CPU (the reference backend, or kernels under the interpreter) every copy is synchronous: the same
code, without streams. A store that fails degrades to a miss (the stores count it and log it once).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch

from deepinfer.engine.block_manager import blocks_for
from deepinfer.kv_tiers import block_codec
from deepinfer.kv_tiers.block_rows import BlockRows
from deepinfer.kv_tiers.copy_streams import StreamCopies, SyncCopies
from deepinfer.kv_tiers.host_tier import HostTier
from deepinfer.kv_tiers.keys import KVNamespace
from deepinfer.kv_tiers.store import KVStore, StoreStats
from deepinfer.kv_tiers.tier_stats import TierCounters, TierTiming

log = logging.getLogger(__name__)

HOST = "host"
CHUNK_BYTES = 256 << 20  # device staging of one gather or load chunk (a V3 block of 64 tokens is 4.5 MB: 56 blocks)
IN_FLIGHT_BYTES = 1 << 30  # device staging waiting for its copy out at once: beyond it the engine waits for the oldest
# Threads reading one fetch's blocks from the stores: a block's read, checksum and decode took ~1.3 ms of one core on an
# H200's host (V4-Flash shape, 4 layers, 290 KB blocks), so a 32k-token prefix read by one thread lost to recomputing it.
READ_THREADS = max(1, min(8, os.cpu_count() or 1))
READ_BATCH = 4 * READ_THREADS  # blocks read at once: a fetch stops at its first missing block, reading at most this many past it


def _timed(field_name: str):
    """Add the call's time to KVTiers.timing's `field_name`, when it is the outermost timed call (wait's polls are
    idle time, not step time)."""

    def wrap(method):
        @functools.wraps(method)
        def timed(self, *args, **kwargs):
            if self._timing_depth:
                return method(self, *args, **kwargs)
            self._timing_depth += 1
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                self._timing_depth -= 1
                setattr(self.timing, field_name, getattr(self.timing, field_name) + time.perf_counter() - start)

        return timed

    return wrap


@dataclass
class _Offload:
    """Blocks whose rows are being copied out of the device."""

    kind: "_Kind"  # blocks or snapshots
    keys: list[str]
    host_rows: list[int | None]  # each block's host-tier row (None: not kept there)
    staging: torch.Tensor  # the gathered rows on the device, held until the copy has read them
    host_copy: torch.Tensor | None  # for the stores, the rows the host tier does not keep (all without one), in pinned memory, in order
    copied: torch.Event | None  # None: the copy was synchronous


@dataclass
class _Write:
    """Blocks being encoded and put into the stores by the writer thread."""

    future: Future  # its result: blocks stored per tier
    kind: "_Kind"
    held: list[int]  # the host-tier rows it reads, held until it ends
    keys: frozenset[str]


@dataclass(eq=False)  # (compared by identity: its fields hold tensors and futures)
class _Fetch:
    """One waiting request's prefix being found in the tiers and copied into device blocks."""

    hashes: list[bytes]  # the chain hashes of its blocks past the device hit, in order
    blocks: int  # the blocks the request holds once admitted (its prompt's) but its device hit
    device_hit: list[int]  # the device blocks of its hit, held while the rest loads (else they could be evicted meanwhile)
    host_rows: list[int]  # host-tier rows of its first blocks (held)
    rest: int = 0  # of `blocks`, those its admission takes from the free blocks (all but the loaded ones), once it holds loaded blocks
    stored: Future | None = None  # the reader's rows of the next blocks, from the stores
    rows: torch.Tensor | None = None  # [k, block_bytes] host rows of the stores' blocks, once read
    tiers: list[str] = field(default_factory=list)  # which tier each block came from
    state: tuple | None = None  # the snapshot of its last loaded block, where it comes from: ("pool",), ("host", row) or ("store", name, row tensor)
    state_entry: int | None = None  # the snapshot pool entry it is copied into
    state_row: int | None = None  # the host tier's row of the snapshot, held until copied
    block_ids: list[int] = field(default_factory=list)  # device blocks copied into
    loaded: torch.Event | None = None
    copying: bool = False
    ready: bool = False


def snapshot_rows(snapshots) -> BlockRows | None:
    """The rows of a state-snapshot pool (`StateSnapshots.pool`: dim 0 the entry), or None without one."""
    return BlockRows({f"state.{i}": t for i, t in enumerate(snapshots.pool)}) if snapshots is not None else None


@dataclass
class _Kind:
    """What is stored per chain hash: the blocks' rows, or the state snapshots (their pool's rows)."""

    rows: BlockRows
    host: HostTier | None
    suffix: str  # appended to the block's store key
    namespace: KVNamespace

    def __post_init__(self) -> None:
        self.layout = self.rows.layout()  # what a stored item must hold (checked on every read)
        self.head = block_codec.head(self.namespace, self.layout)  # what a stored item of this layout starts with

    def key(self, block_hash: bytes) -> str:
        return self.namespace.key(block_hash) + self.suffix


class KVTiers:
    def __init__(self, rows: BlockRows, namespace: KVNamespace, block_manager, host: HostTier | None, stores: list[tuple[str, KVStore]],
                 copies: StreamCopies | SyncCopies, states: BlockRows | None = None, host_states: HostTier | None = None):  # fmt: skip
        """rows: the model's paged caches; stores: (tier name, store) from fastest to slowest; copies: where the copies
        run (copy_streams: side streams of an accelerator, or synchronously on the CPU). With state snapshots (the
        block manager keeps them): states, the rows of their pool (`snapshot_rows`), and host_states, the host tier's
        rows for them (module docstring)."""
        if host is None and not stores:
            raise ValueError("KVTiers needs a host tier or a store")
        self.rows, self.namespace, self.block_manager = rows, namespace, block_manager
        self.host, self.stores = host, stores
        self.snapshots = block_manager.snapshots
        self.blocks_kind = _Kind(rows, host, "", namespace)
        if (states is None) != (self.snapshots is None):
            raise ValueError("KVTiers needs the snapshot pool's rows exactly when the block manager keeps snapshots")
        self.states_kind = _Kind(states, host_states, "-state", namespace) if states is not None else None
        self.device = rows.device
        self.copies = copies
        # stores only: one writer (encodes and puts, in offload order), one reader (a fetch at a time, in request order)
        # spreading each fetch's blocks over the block readers
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-kv-write") if stores else None
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-kv-read") if stores else None
        self.block_readers = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="deepinfer-kv-block") if stores else None
        self.offloads: list[_Offload] = []
        self.writes: list[_Write] = []  # store writes in flight
        self.fetches: dict[int, _Fetch] = {}  # seq_id -> its fetch
        self.counters = {name: TierCounters() for name in [HOST] * (host is not None) + [name for name, _ in stores]}
        self.timing = TierTiming()
        self._timing_depth = 0
        block_manager.on_evictable = self.offload
        if self.states_kind is not None:
            block_manager.on_snapshot = self.offload_snapshot

    # -- offload -------------------------------------------------------------------------------

    @_timed("engine_s")
    def offload(self, blocks: list[tuple[int, bytes]]) -> None:
        """Copy out cached blocks that just became evictable (block id, chain hash), those no tier holds yet."""
        self._offload(self.blocks_kind, [(b, self.blocks_kind.key(h)) for b, h in blocks])

    @_timed("engine_s")
    def offload_snapshot(self, block_hash: bytes, entry: int) -> None:
        """Copy out a state snapshot as it is filed (the pool keeps few, LRU: by the time its block is evicted it may
        be gone)."""
        self._offload(self.states_kind, [(entry, self.states_kind.key(block_hash))])

    def _offload(self, kind: _Kind, items: list[tuple[int, str]]) -> None:
        """Copy out rows of `kind` (row index in its tensors, store key) that its host tier does not hold yet, in chunks
        of at most CHUNK_BYTES of device staging, with at most IN_FLIGHT_BYTES of it waiting for its copy at once."""
        todo = [(i, k) for i, k in items if kind.host is None or k not in kind.host]
        per_chunk = max(1, CHUNK_BYTES // kind.rows.block_bytes)
        for start in range(0, len(todo), per_chunk):
            chunk = todo[start : start + per_chunk]
            while self.offloads and sum(off.staging.numel() for off in self.offloads) + len(chunk) * kind.rows.block_bytes > IN_FLIGHT_BYTES:
                self._stall(self.offloads[0].copied)  # rare: a request of many blocks freed at once; its copies are queued already
                self._finish_offloads()
            ids = torch.tensor([i for i, _ in chunk], dtype=torch.long, device=self.device)
            keys = [k for _, k in chunk]
            staging = kind.rows.gather(ids)  # on the engine's stream: reads the rows before any later step writes them
            host_rows = [kind.host.reserve(k) for k in keys] if kind.host is not None else [None] * len(keys)
            with self.copies.on("offload"):
                host_copy = self._copy_out(kind, staging, host_rows)
                copied = self.copies.done("offload")
            self.offloads.append(_Offload(kind, keys, host_rows, staging, host_copy, copied))
            if copied is None:
                self._finish_offloads()

    def _copy_out(self, kind: _Kind, staging: torch.Tensor, host_rows: list[int | None]) -> torch.Tensor | None:
        """Queue the copies of the gathered rows to the host tier's rows, and, for the stores, of those it does not keep
        (every row without a host tier; a full one refuses rows) to pinned memory; returns that pinned copy or None."""
        for i, row in enumerate(host_rows):
            if row is not None:
                kind.host.rows[row].copy_(staging[i], non_blocking=self.copies.pinned)
        unkept = [i for i, row in enumerate(host_rows) if row is None]
        if not self.stores or not unkept:
            return None
        rows = staging if len(unkept) == len(host_rows) else staging[torch.tensor(unkept, device=staging.device)]
        out = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=self.copies.pinned)
        out.copy_(rows, non_blocking=self.copies.pinned)
        return out

    def _finish_offloads(self) -> None:
        """Offloads whose copies have completed: their host rows become findable and the stores get them."""
        left = []
        for off in self.offloads:
            if off.copied is not None and not off.copied.query():
                left.append(off)
                continue
            host, blocks = off.kind.host, off.kind is self.blocks_kind
            for key, row in zip(off.keys, off.host_rows):
                if row is not None:
                    host.complete(key)
                    self.counters[HOST].stores += blocks
            if self.stores:
                held = [r for r in off.host_rows if r is not None]
                for r in held:
                    host.hold(r)
                unkept = iter(range(len(off.keys)))
                sources = [(host.rows, r) if r is not None else (off.host_copy, next(unkept)) for r in off.host_rows]
                future = self.writer.submit(self._write, off.kind, list(zip(off.keys, sources)))
                self.writes.append(_Write(future, off.kind, held, frozenset(off.keys)))
        self.offloads = left
        self._finish_writes()

    def _write(self, kind: _Kind, items: list[tuple[str, tuple[torch.Tensor, int]]]) -> dict[str, int]:
        """Writer thread: encode each item (key, (host rows, row)) and put it in every store that does not hold it;
        items stored per tier."""
        stored = {name: 0 for name, _ in self.stores}
        for key, (rows, row) in items:
            data = None
            for name, store in self.stores:
                if store.contains(key):
                    continue
                if data is None:
                    data = block_codec.encode(kind.rows.split(rows[row]), self.namespace)
                stored[name] += int(store.put(key, data))
        return stored

    def _finish_writes(self) -> None:
        left = []
        for write in self.writes:
            if not write.future.done():
                left.append(write)
                continue
            for r in write.held:
                write.kind.host.release(r)
            stored = self._result(write.future, {})
            if write.kind is self.blocks_kind:  # (the counters count blocks; snapshots travel beside them)
                for name, n in stored.items():
                    self.counters[name].stores += n
        self.writes = left

    @staticmethod
    def _result(future: Future, default):
        """A worker job's result; an exception in it (a bug: stores do not raise) is logged, and `default` used."""
        try:
            return future.result()
        except Exception:
            log.exception("a KV tier job failed; its blocks are treated as missing")
            return default

    # -- load ----------------------------------------------------------------------------------

    @_timed("engine_s")
    def admissible(self, seq) -> bool:
        """Whether seq may be admitted now: True when its tiers were looked in (and what they held is in device
        blocks) or hold nothing past its device hit; False while its blocks are found or copied in (it starts that)."""
        fetch = self.fetches.get(seq.seq_id)
        if fetch is not None:
            return fetch.ready
        # looked up again at every scheduling pass until a fetch starts: a device hit seen now may be evicted before
        # the request is admitted, and what it lacks may reach the host tier meanwhile (a dict lookup: cheap)
        device_hit, hashes = self._lookup(seq)
        if not hashes or (not self.stores and (self.host is None or self.namespace.key(hashes[0]) not in self.host.entries)):
            return True
        bm = self.block_manager
        revived = sum(bm.blocks[b].ref_count == 0 for b in device_hit)  # cached but free: holding them takes free blocks
        if revived and (any(self._waits_for_blocks(f) for f in self.fetches.values()) or revived > bm.num_free_blocks - self._owed()):
            return False  # its hit would take blocks an earlier request's load or admission needs: looked up again later
        host_rows = []
        for h in hashes:
            row = self.host.find(self.namespace.key(h)) if self.host is not None else None
            if row is None:
                break
            self.host.hold(row)
            host_rows.append(row)
        blocks = blocks_for(seq.num_tokens, bm.block_size) - len(device_hit)
        bm.hold_blocks(device_hit)
        fetch = _Fetch(hashes, blocks, device_hit, host_rows, tiers=[HOST] * len(host_rows))
        if self.stores and (len(host_rows) < len(hashes) or self.states_kind is not None):
            keys = [self.namespace.key(h) for h in hashes[len(host_rows) :]]
            state_keys = [self.states_kind.key(h) for h in hashes] if self.states_kind is not None else None
            wanted = set(keys) | set(state_keys or ())
            writes = [w.future for w in self.writes if not wanted.isdisjoint(w.keys)]  # its blocks' writes in flight
            fetch.stored = self.reader.submit(self._read, keys, state_keys, len(host_rows), writes)
        self.fetches[seq.seq_id] = fetch
        self._advance(fetch)
        return fetch.ready

    def reserved_blocks(self, seq) -> int:
        """The free blocks seq's fetch waits for before its copy can start (0 when it waits for nothing of the pool's).
        The scheduler keeps them free while admitting later requests: in a pool of a few long requests, those would
        otherwise take every block that frees up, and the load would wait until its request was admitted without it."""
        fetch = self.fetches.get(seq.seq_id)
        return fetch.blocks if fetch is not None and self._waits_for_blocks(fetch) else 0

    def holds_loaded(self, seq) -> bool:
        """Whether seq's fetch holds device blocks it loaded (admitting it frees the pool sooner than holding it back)."""
        fetch = self.fetches.get(seq.seq_id)
        return fetch is not None and bool(fetch.block_ids)

    def _lookup(self, seq) -> tuple[list[int], list[bytes]]:
        """seq's device hit (block ids) and the chain hashes of its full prompt blocks past it that a hit may cover."""
        bm = self.block_manager
        hit = bm.cached_prefix(seq)
        return hit, [seq.block_hash(i, bm.block_size) for i in range(len(hit), bm.hit_bound(seq))]

    def _read(self, keys: list[str], state_keys: list[str] | None, before: int, writes: list[Future]) -> tuple[torch.Tensor, list[str], tuple | None]:
        """Reader thread: the consecutive blocks of `keys` found in the stores, from the first, as pinned rows, and which
        store gave each; stops at the first block no store has (or has damaged: the store drops it). With snapshots
        (state_keys: one per block of the fetch, `before` of them ahead of `keys`' first): the last block found whose
        snapshot a store holds, as (blocks up to it, store, pinned row), or None. `writes`: the store writes in flight
        of these keys when the fetch started, waited for first (a block being written is not missed)."""
        wait_futures(writes)
        rows = torch.empty((len(keys), self.rows.block_bytes), dtype=torch.uint8, pin_memory=self.copies.pinned)
        good: list[str] = []
        for start in range(0, len(keys), READ_BATCH):
            batch = range(start, min(start + READ_BATCH, len(keys)))
            for found in self.block_readers.map(lambda i: self._get(self.blocks_kind, keys[i], rows[i]), batch):
                if found is None:
                    break
                good.append(found)
            if len(good) < batch.stop:
                break
        state = None
        if state_keys is not None:
            row = torch.empty(self.states_kind.rows.block_bytes, dtype=torch.uint8, pin_memory=self.copies.pinned)
            for end in range(before + len(good), 0, -1):
                found = self._get(self.states_kind, state_keys[end - 1], row)
                if found is not None:
                    state = (end, found, row)
                    break
        return rows[: len(good)], good, state

    def _get(self, kind: _Kind, key: str, out: torch.Tensor) -> str | None:
        """Block reader thread: the item of `key` from the first store that has it whole and of this cache's layout, decoded
        into `out`; the store's name, or None (a damaged or foreign item is dropped from its store)."""
        for name, store in self.stores:
            if hasattr(store, "get_into"):  # a store that reads into the row itself (the disk store): one copy, one checksum pass
                if store.get_into(key, kind.head, out.numpy()):
                    return name
                continue
            data = store.get(key)
            if data is None:
                continue
            try:
                block_codec.decode_row(data, self.namespace, kind.layout, out)
                return name
            except (block_codec.CorruptBlock, ValueError) as exc:  # damaged past the store's own check, another namespace's or layout's
                log.warning("KV item %s in the %s tier is unusable (%s): recomputed", key[:16], name, exc)
                store.delete(key)
        return None

    def _advance(self, fetch: _Fetch) -> None:
        """Move a fetch on as far as it goes without waiting: stores read -> device blocks taken and copied in -> ready."""
        if fetch.ready:
            return
        stored_state = None
        if fetch.stored is not None:
            if not fetch.stored.done():
                return
            rows, names, stored_state = self._result(fetch.stored, (None, [], None))
            fetch.stored, fetch.rows = None, rows
            fetch.tiers += names
        if self.snapshots is not None and not fetch.copying and fetch.state is None:
            self._choose_state(fetch, stored_state)
        if not fetch.copying:
            count = len(fetch.tiers)
            if count == 0:
                fetch.ready = True
                return
            if self._earlier_waits_for_blocks(fetch) or not self._room_for(fetch):
                return  # not enough free blocks for it to be admitted beside the loads before it: tried again at the next poll
            if self._files_state(fetch) and any(self._files_state(f) and f.copying for f in self.fetches.values()):
                return  # one loaded snapshot waits for its request at a time: the pool's LRU would push out another
            block_ids = self.block_manager.take_blocks(count)
            fetch.rest = fetch.blocks - count
            fetch.block_ids = block_ids
            self._copy_in(fetch)
        if fetch.loaded is not None and not fetch.loaded.query():
            return
        self._loaded(fetch)

    def _choose_state(self, fetch: _Fetch, stored: tuple | None) -> None:
        """Cut the fetch at the last of its blocks whose snapshot the device's pool, the host tier or a store holds
        (a hit must end on a snapshot), and note where that snapshot comes from; ("none",) when no block has one."""
        n_host = len(fetch.host_rows)
        fetch.state = ("none",)
        for end in range(len(fetch.tiers), 0, -1):
            block_hash = fetch.hashes[end - 1]
            if self.snapshots.entry(block_hash) is not None:
                fetch.state = ("pool",)
            elif self.states_kind.host is not None and (row := self.states_kind.host.find(self.states_kind.key(block_hash))) is not None:
                self.states_kind.host.hold(row)
                fetch.state, fetch.state_row = ("host", row), row
            elif stored is not None and stored[0] == end:
                fetch.state = ("store", stored[1], stored[2])
            else:
                continue
            break
        else:
            end = 0
        for row in fetch.host_rows[end:]:
            self.host.release(row)
        fetch.host_rows = fetch.host_rows[:end]
        fetch.tiers = fetch.tiers[:end]
        if fetch.rows is not None:
            fetch.rows = fetch.rows[: max(0, end - n_host)]

    @staticmethod
    def _files_state(fetch: _Fetch) -> bool:
        """Whether the fetch copies a snapshot into the device's pool (one a tier held)."""
        return fetch.state is not None and fetch.state[0] in ("host", "store")

    @staticmethod
    def _waits_for_blocks(fetch: _Fetch) -> bool:
        """Whether the fetch has its rows but waits for free device blocks to copy them into."""
        return not (fetch.ready or fetch.copying or fetch.stored is not None or not fetch.tiers)

    def _earlier_waits_for_blocks(self, fetch: _Fetch) -> bool:
        """Whether a fetch of an earlier request waits for free blocks. Fetches take blocks in request order: a later
        one with a smaller need would otherwise take what frees up first, again and again, and the earlier request
        would end up admitted without its prefix."""
        for _, other in self._in_request_order():
            if other is fetch:
                return False
            if self._waits_for_blocks(other):
                return True
        return False

    def _room_for(self, fetch: _Fetch) -> bool:
        """Whether the free blocks hold the fetch's request beside what the loads before it still need; if not, and
        letting later requests' fetches go (those not copying) would make room, they go: what they loaded or held stays
        in the device prefix cache (cached, free) and their requests are looked up again. Otherwise, in a pool of a few
        long requests, later requests' held hits could keep an earlier load from ever starting."""
        bm = self.block_manager
        if fetch.blocks + self._owed() <= bm.num_free_blocks:
            return True
        fetches = self._in_request_order()
        after = next(i for i, (_, f) in enumerate(fetches) if f is fetch) + 1
        later = [(seq_id, f) for seq_id, f in fetches[after:] if not (f.copying and not f.ready)]  # (a copy in flight cannot stop)
        freed = sum(sum(bm.blocks[b].ref_count == 1 for b in f.device_hit + f.block_ids) + (f.rest if f.block_ids else 0) for _, f in later)
        if fetch.blocks + self._owed() > bm.num_free_blocks + freed:
            return False
        for seq_id, f in later:
            if f.stored is not None:
                f.stored.cancel()  # (a read in progress finishes; its rows are dropped)
            self._let_go(f, blocks=True)
            del self.fetches[seq_id]
        return fetch.blocks + self._owed() <= bm.num_free_blocks

    def _in_request_order(self) -> list[tuple[int, _Fetch]]:
        """(seq id, fetch) in request order: seq ids count up with arrival; the dict's order is creation order, and a
        fetch that gave way is created again later."""
        return sorted(self.fetches.items(), key=lambda item: item[0])

    def _owed(self) -> int:
        """Free blocks the requests whose loads hold device blocks still need to be admitted."""
        return sum(f.rest for f in self.fetches.values() if f.block_ids)

    def _copy_in(self, fetch: _Fetch) -> None:
        """Queue the copies of the fetch's rows into its device blocks (on the load stream)."""
        fetch.copying = True
        ids = torch.tensor(fetch.block_ids, dtype=torch.long, device=self.device)

        per_chunk = max(1, CHUNK_BYTES // self.rows.block_bytes)
        with self.copies.on("load"):  # after the blocks' last readers on the engine's stream
            for start in range(0, len(fetch.block_ids), per_chunk):  # (a chunk's staging is reused in stream order)
                end = min(start + per_chunk, len(fetch.block_ids))
                staging = torch.empty((end - start, self.rows.block_bytes), dtype=torch.uint8, device=self.device)
                for lo, hi, source in self._runs(fetch, start, end):
                    staging[lo - start : hi - start].copy_(source, non_blocking=self.copies.pinned)
                self.rows.scatter(ids[start:end], staging)
            if fetch.state is not None and fetch.state[0] in ("host", "store"):
                source = self.states_kind.host.rows[fetch.state[1]] if fetch.state[0] == "host" else fetch.state[2]
                fetch.state_entry = self.snapshots.take()
                row = source.to(self.device, non_blocking=self.copies.pinned).unsqueeze(0)
                self.states_kind.rows.scatter(torch.tensor([fetch.state_entry], device=self.device), row)
            fetch.loaded = self.copies.done("load")

    def _runs(self, fetch: _Fetch, start: int, end: int):
        """The fetch's blocks start..end as (first, past, source rows): runs of consecutive host-tier rows, and the stores'
        rows (contiguous), so that a load takes one copy a run, not one a block (a 32k-token prefix is ~500 blocks, and
        each copy costs the engine thread a few microseconds)."""
        n_host, i = len(fetch.host_rows), start
        while i < end:
            if i < n_host:
                row, j = fetch.host_rows[i], i + 1
                while j < min(end, n_host) and fetch.host_rows[j] == row + (j - i):
                    j += 1
                yield i, j, self.host.rows[row : row + (j - i)]
            else:
                j = end
                yield i, j, fetch.rows[i - n_host : j - n_host]
            i = j

    def _loaded(self, fetch: _Fetch) -> None:
        """The rows are in the device blocks: they join the prefix cache, held for the request; host rows let go."""
        self.block_manager.register_loaded(fetch.block_ids, fetch.hashes[: len(fetch.block_ids)])
        if fetch.state_entry is not None:
            self.snapshots.file(fetch.hashes[len(fetch.block_ids) - 1], fetch.state_entry)
            fetch.state_entry = None
        for name in fetch.tiers:
            counters = self.counters[name]
            counters.hit_blocks += 1
            counters.hit_bytes += self.rows.block_bytes
        for name in set(fetch.tiers):
            self.counters[name].loads += 1
        self._let_go(fetch, blocks=False)
        fetch.rows = fetch.loaded = None
        fetch.ready = True

    def _let_go(self, fetch: _Fetch, blocks: bool) -> None:
        for row in fetch.host_rows:
            self.host.release(row)
        fetch.host_rows = []
        if fetch.state_row is not None:
            self.states_kind.host.release(fetch.state_row)
            fetch.state_row = None
        if fetch.state_entry is not None:  # copied in, never filed (the request left)
            self.snapshots.release(fetch.state_entry)
            fetch.state_entry = None
        if blocks and (fetch.block_ids or fetch.device_hit):
            self.block_manager.release_loaded(fetch.device_hit + fetch.block_ids)
            fetch.block_ids, fetch.device_hit = [], []

    @_timed("engine_s")
    def admitted(self, seq) -> None:
        """seq was admitted (its allocation took its loaded blocks): the fetch's hold on them ends."""
        fetch = self.fetches.pop(seq.seq_id, None)
        if fetch is not None:
            self._let_go(fetch, blocks=True)

    @_timed("engine_s")
    def forget(self, seq) -> None:
        """seq left before it was admitted (aborted): what its fetch holds goes back once its copies are done."""
        fetch = self.fetches.pop(seq.seq_id, None)
        if fetch is None:
            return
        if fetch.stored is not None:
            fetch.stored.cancel()
        if fetch.loaded is not None:
            self._stall(fetch.loaded)  # rare (an abort mid-copy): the blocks must not be handed out while written
        self._let_go(fetch, blocks=True)

    def _stall(self, event: torch.Event) -> None:
        """Block the engine thread on a copy (counted: a step waits)."""
        start = time.perf_counter()
        event.synchronize()
        self.timing.stalled_s += time.perf_counter() - start
        self.timing.stalls += 1

    # -- the engine loop -----------------------------------------------------------------------

    @_timed("engine_s")
    def poll(self) -> None:
        """Advance everything that has completed (never waits): offloads, store writes, fetches."""
        self._finish_offloads()
        for seq_id in list(self.fetches):  # (a fetch may let later ones go)
            fetch = self.fetches.get(seq_id)
            if fetch is not None:
                self._advance(fetch)

    def holds_blocks(self) -> bool:
        """Whether a fetch holds device blocks (its request's device hit, or blocks loaded for it)."""
        return any(f.block_ids or f.device_hit for f in self.fetches.values())

    def busy(self) -> bool:
        """Whether a fetch is still being read or copied in."""
        return any(not f.ready for f in self.fetches.values())

    @_timed("idle_s")
    def wait(self) -> bool:
        """Block until some fetch can move on (the engine calls this only when nothing else can run); False when
        none is in flight (each is ready, or waits for free device blocks)."""
        futures = [f.stored for f in self.fetches.values() if f.stored is not None]
        events = [f.loaded for f in self.fetches.values() if f.loaded is not None and not f.ready]
        if events:
            events[0].synchronize()
        elif futures:
            wait_futures(futures, return_when=FIRST_COMPLETED)
        self.poll()
        return bool(events or futures)

    @_timed("engine_s")
    def release_loads(self, look_again: bool = False) -> int:
        """Let go of every device block held for a waiting request whose copy is not in flight (they stay in the device
        prefix cache, where the request finds them as any hit, unless something evicts them first); such fetches end.
        look_again: their requests are looked up again at the next pass (a running request needed the blocks: it makes
        progress meanwhile); else they are admitted as they stand (nothing runs: looking again could go round forever).
        When nothing runs, requests that each hold part of a small pool could otherwise wait for each other, and a
        running request that needs a block must not be preempted for a waiting one. Returns the blocks let go."""
        released = 0
        for seq_id, fetch in list(self.fetches.items()):
            if fetch.loaded is None or fetch.ready:
                released += len(fetch.block_ids) + len(fetch.device_hit)
                if fetch.stored is not None:
                    fetch.stored.cancel()  # (a read in progress finishes; its rows are dropped)
                self._let_go(fetch, blocks=True)
                if look_again:
                    del self.fetches[seq_id]  # what it loaded is a device hit at the next lookup
                else:
                    fetch.ready = True
        return released

    def drain(self) -> None:
        """Wait for every offload and store write (a benchmark's or a test's end; the engine's close)."""
        for off in self.offloads:
            if off.copied is not None:
                off.copied.synchronize()
        self._finish_offloads()
        for write in self.writes:
            write.future.exception()
        self._finish_writes()

    def close(self) -> None:
        self.drain()
        for pool in (self.reader, self.block_readers, self.writer):
            if pool is not None:
                pool.shutdown(wait=True)

    def stats(self) -> dict[str, dict]:
        """Per tier: the engine's counters (hit blocks and bytes, loads, stores) and the tier's own (entries, bytes held,
        evictions, expired, errors, corrupt)."""
        out = {}
        for name, counters in self.counters.items():
            own = self.host.snapshot() if name == HOST else dict(self.stores)[name].stats()
            out[name] = counters.report(own if isinstance(own, StoreStats) else StoreStats())
        return out
