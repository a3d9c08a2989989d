"""Paged KV blocks with reference counts and prefix caching by chained block hashes.

A block holds the KV of `block_size` consecutive tokens of one or more sequences (several when
they share a cached prefix). A full, computed block is registered under its chained hash
(`Sequence.block_hash`); a later sequence whose leading blocks have the same hashes reuses them
instead of recomputing. A block whose last user leaves keeps its hash and its data until it is
handed out again: free blocks are an LRU queue, blocks without a hash (nothing to lose) first.

A model with per-sequence state outside the blocks (a state slot) either recomputes the last
`prefix_replay_tokens` before a hit's end to rebuild it (DeepSeek-V4), or keeps snapshots of the slot at
block boundaries (`StateSnapshots`, DeepSeek-V4.1): a hit then reaches only the longest cached block whose
snapshot is kept (and no further than the model's `hit_limit`), restores it and computes nothing before it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from deepinfer.engine.sequence import Sequence
from deepinfer.engine.state_snapshots import StateSnapshots


class Block:
    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, refs={self.ref_count}, cached={self.hash is not None})"


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *, num_state_slots: int = 0, prefix_replay_tokens: int = 0):
        """num_state_slots: per-sequence model state (DeepSeek-V4's compressor windows), one per
        running sequence (0: the model keeps none). prefix_replay_tokens: on a prefix hit, this many
        tokens before the first uncached one are computed again (bounded replay: they rebuild that
        state; their KV stays as cached)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_replay_tokens = prefix_replay_tokens
        self.uses_state_slots = num_state_slots > 0
        self.free_slots = list(range(num_state_slots - 1, -1, -1))  # pop() hands out the lowest
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front: reused first
        self.cached: dict[bytes, int] = {}  # chained hash -> block id
        self.snapshots: StateSnapshots | None = None  # the state slots' snapshots (`keep_snapshots`)
        self.hit_limit: Callable[[Sequence], int] | None = None  # the most positions a sequence's hit may cover
        self.launched: dict[int, tuple[int, int]] = {}  # seq_id -> (boundary, snapshot entry) captured when its step was launched
        # the KV tiers' hook (deepinfer.kv_tiers.tiered_cache): called with the cached blocks (id, chain hash) that just became
        # evictable, before anything can evict them
        self.on_evictable: Callable[[list[tuple[int, bytes]]], None] | None = None
        self.on_snapshot: Callable[[bytes, int], None] | None = None  # and with the (block hash, pool entry) of each snapshot filed

    def keep_snapshots(self, snapshots: StateSnapshots, hit_limit: Callable[[Sequence], int] | None = None) -> None:
        """Prefix hits restore state-slot snapshots instead of recomputing (module docstring); hit_limit(seq): the
        most positions a hit of seq may cover (DeepSeek-V4.1's bounded replay: its decoder tail's start)."""
        self.snapshots, self.hit_limit = snapshots, hit_limit

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    # -- admission ---------------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of the cached blocks that hold seq's leading full blocks. At least one token is
        always left to compute: the step that computes it yields the logits to sample from. With
        snapshots, only up to the last block whose snapshot is kept, within the hit limit."""
        hits, usable = [], 0
        for index in range(self.hit_bound(seq)):
            block_hash = seq.block_hash(index, self.block_size)
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
            if self.snapshots is None or block_hash in self.snapshots:
                usable = len(hits)
        return hits[:usable]

    def hit_bound(self, seq: Sequence) -> int:
        """The most leading full blocks of seq a prefix hit may cover (0: seq reads no prefix cache): all but the last
        token is left to compute, and no further than the model's hit limit."""
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return 0
        most = (seq.num_tokens - 1) // self.block_size
        if self.hit_limit is not None:
            most = min(most, self.hit_limit(seq) // self.block_size)
        return most

    def can_allocate(self, seq: Sequence, keep_free: int = 0) -> bool:
        """Whether seq's pages fit now, leaving `keep_free` free blocks (those an earlier request's tier load waits for)."""
        if self.uses_state_slots and not self.free_slots:
            return False
        hits = self.cached_prefix(seq)
        fresh = blocks_for(seq.num_tokens, self.block_size) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # cached but free: leaves the free queue
        return fresh + revived + keep_free <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Pages for all of seq's tokens: cached prefix blocks shared, the rest fresh. Sets
        seq.num_computed_tokens to the cached prefix length."""
        assert not seq.block_table, f"{seq} already holds blocks"
        hits = self.cached_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
        fresh = [self._take_free_block() for _ in range(blocks_for(seq.num_tokens, self.block_size) - len(hits))]
        seq.block_table = hits + fresh
        seq.num_cached_kv = len(hits) * self.block_size
        if self.uses_state_slots:
            seq.state_slot = self.free_slots.pop()
        if self.snapshots is not None:  # the state at the hit's end restored: continue from there
            seq.num_computed_tokens = seq.num_cached_kv
            if hits:
                self.snapshots.restore(seq.block_hash(len(hits) - 1, self.block_size), seq.state_slot)
        else:
            seq.num_computed_tokens = max(0, seq.num_cached_kv - self.prefix_replay_tokens) if hits else 0

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached content
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                if self.snapshots is not None:  # unreachable without its block
                    self.snapshots.drop(block.hash)
            block.hash = None
        block.ref_count = 1
        return block_id

    # -- decode ------------------------------------------------------------------------------

    def new_blocks_needed(self, seq: Sequence, lookahead: int = 0) -> int:
        """Pages seq lacks for its tokens and `lookahead` positions after them (speculative drafts)."""
        return max(0, blocks_for(seq.num_tokens + lookahead, self.block_size) - len(seq.block_table))

    def needs_new_block(self, seq: Sequence) -> bool:
        return self.new_blocks_needed(seq) > 0

    def can_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Whether seq's newest token (and `lookahead` positions after it) can get slots."""
        return self.new_blocks_needed(seq, lookahead) <= self.num_free_blocks

    def append_slot(self, seq: Sequence, lookahead: int = 0) -> None:
        for _ in range(self.new_blocks_needed(seq, lookahead)):
            seq.block_table.append(self._take_free_block())

    # -- after a step ------------------------------------------------------------------------

    def commit(self, seq: Sequence, old_computed: int, computed: int | None = None) -> None:
        """Register the blocks that became full and computed since `old_computed` tokens, up to
        `computed` (default seq.num_computed_tokens; overlap scheduling: the tokens after it are
        not known on the host yet)."""
        if not self.enable_prefix_caching:
            return
        computed = seq.num_computed_tokens if computed is None else computed
        for index in range(old_computed // self.block_size, computed // self.block_size):
            block = self.blocks[seq.block_table[index]]
            if block.hash is not None:  # a cache hit: registered already
                continue
            block_hash = seq.block_hash(index, self.block_size)
            if block_hash not in self.cached:  # else another sequence computed the same prefix first
                self.cached[block_hash] = block.block_id
                block.hash = block_hash
        if self.snapshots is not None and computed > old_computed and computed % self.block_size == 0 and seq.state_slot >= 0:
            self._snapshot(seq, computed)

    def _snapshot(self, seq: Sequence, boundary: int) -> None:
        """File seq's state at `boundary` (a block's end) under that block's hash: the copy taken when the step
        that reached it was launched (`note_launched`), else its slot now (nothing has run since that step)."""
        block_hash = seq.block_hash(boundary // self.block_size - 1, self.block_size)
        launched = self.launched.pop(seq.seq_id, None)
        if launched is not None and launched[0] == boundary:
            self.snapshots.file(block_hash, launched[1])
        else:
            if launched is not None:
                self.snapshots.release(launched[1])
            self.snapshots.save(block_hash, seq.state_slot)
        if self.on_snapshot is not None:
            self.on_snapshot(block_hash, self.snapshots.entry(block_hash))

    def _release_launched(self, seq: Sequence) -> None:
        """Give back the copy of seq's slot taken when its last step was launched, if one is waiting (`note_launched`)."""
        launched = self.launched.pop(seq.seq_id, None)
        if launched is not None:
            self.snapshots.release(launched[1])

    def note_launched(self, seq: Sequence, computed: int) -> None:
        """A step that leaves seq with `computed` tokens computed was launched, and its tokens will be known
        only after a later step is launched (overlap scheduling): when that is a block boundary, copy the
        slot now, in the device's order, for `commit` to file."""
        if self.snapshots is None or computed % self.block_size or seq.state_slot < 0:
            return
        self._release_launched(seq)
        self.launched[seq.seq_id] = (computed, self.snapshots.capture(seq.state_slot))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (benchmarks: a repeated workload then computes what it computed
        the first time, not cache hits). Only while no sequence holds a page, as vLLM's: False, and
        nothing forgotten, otherwise."""
        if any(block.ref_count for block in self.blocks):
            return False
        for block in self.blocks:
            block.hash = None
        self.cached.clear()
        if self.snapshots is not None:
            self.snapshots.clear()
        return True

    def free(self, seq: Sequence) -> None:
        """Release seq's pages. Its last blocks go first in the LRU order: a shared prefix lives at the
        front of a sequence, so its head blocks are the ones worth keeping."""
        self._unref(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_kv = 0
        self._release_launched(seq)  # its step ended it: a copy taken at its launch is filed nowhere
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = -1

    def _unref(self, block_ids) -> None:
        """Drop one reference to each block; those left unused join the free queue (a cached one at its back, an
        empty one at its front) and the cached ones are offered to the KV tiers (`on_evictable`)."""
        evictable = []
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.hash is None:  # holds nothing reusable: hand it out before cached blocks
                    self.free_blocks.move_to_end(block_id, last=False)
                else:
                    evictable.append((block_id, block.hash))
        if evictable and self.on_evictable is not None:
            self.on_evictable(evictable)

    # -- the KV tiers' loads ---------------------------------------------------------------------

    def take_blocks(self, count: int) -> list[int] | None:
        """`count` free blocks, held (a reference each) for a load from a KV tier; None when fewer are free."""
        if count > self.num_free_blocks:
            return None
        return [self._take_free_block() for _ in range(count)]

    def hold_blocks(self, block_ids: list[int]) -> None:
        """Take a reference to cached blocks (a waiting request's device hit, kept while the rest of its prefix loads)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1

    def register_loaded(self, block_ids: list[int], hashes: list[bytes]) -> None:
        """Blocks a KV tier's rows were copied into join the prefix cache under their chain hashes (still held);
        one whose hash is cached already (computed meanwhile) stays empty."""
        for block_id, block_hash in zip(block_ids, hashes):
            if block_hash not in self.cached:
                self.cached[block_hash] = block_id
                self.blocks[block_id].hash = block_hash

    def release_loaded(self, block_ids: list[int]) -> None:
        """A load's hold on its blocks ends (its request was admitted and took its own references, or left)."""
        self._unref(block_ids)
