"""The paged KV block manager: reference counts, the chained prefix hashes, cache hits, eviction."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.sequence import ROOT_HASH, Sequence

_ids = iter(range(10**6))


def seq(tokens) -> Sequence:
    return Sequence(next(_ids), list(tokens), SamplingParams(), seed=0)


def computed(manager: BlockManager, s: Sequence) -> Sequence:
    """Pretend a forward pass computed every token of s, as the scheduler reports it."""
    old = s.num_computed_tokens
    s.num_computed_tokens = s.num_tokens
    manager.commit(s, old)
    return s


def test_allocate_and_free_keep_reference_counts():
    manager = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))  # 3 blocks: 4 + 4 + 2
    manager.allocate(a)
    assert len(a.block_table) == 3 and len(set(a.block_table)) == 3
    assert [manager.blocks[b].ref_count for b in a.block_table] == [1, 1, 1]
    assert manager.num_free_blocks == 5 and a.num_computed_tokens == 0
    manager.free(a)
    assert a.block_table == [] and manager.num_free_blocks == 8
    assert all(block.ref_count == 0 for block in manager.blocks)


def test_block_hashes_chain_over_the_whole_prefix():
    bs = 4
    a, b = seq([1, 2, 3, 4, 5, 6, 7, 8, 9]), seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    c = seq([9, 2, 3, 4, 5, 6, 7, 8])  # same second block as a, different first block
    assert a.block_hash(0, bs) == b.block_hash(0, bs) and a.block_hash(1, bs) == b.block_hash(1, bs)
    assert a.block_hash(0, bs) != c.block_hash(0, bs)
    assert a.block_hash(1, bs) != c.block_hash(1, bs), "a block's hash must depend on every earlier block"
    # The chain, recomputed by hand: blake2b-128 over the parent hash then the tokens as int64 little-endian.
    parent = ROOT_HASH
    for block in ([1, 2, 3, 4], [5, 6, 7, 8]):
        parent = hashlib.blake2b(parent + b"".join(t.to_bytes(8, "little", signed=True) for t in block), digest_size=16).digest()
    assert a.block_hash(1, bs) == parent


def test_block_hashes_repeat_across_processes():
    code = "from deepinfer.engine.sequence import chain_hash, ROOT_HASH; print(chain_hash(ROOT_HASH, [5, 6, 7]).hex())"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": str(s)}).stdout
        for s in (1, 2)
    }
    assert len(outs) == 1


def test_cached_prefix_is_shared_and_counted():
    manager = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))
    manager.allocate(a)
    computed(manager, a)
    b = seq([*range(8), 99, 98, 97])  # shares a's two full blocks
    assert manager.cached_prefix(b) == a.block_table[:2]
    manager.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert b.num_computed_tokens == 8
    assert [manager.blocks[x].ref_count for x in b.block_table] == [2, 2, 1]
    manager.free(a)
    assert [manager.blocks[x].ref_count for x in b.block_table] == [1, 1, 1]


def test_a_hit_always_leaves_one_token_to_compute():
    manager = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(8))
    manager.allocate(a)
    computed(manager, a)
    same = seq(range(8))  # identical, and a whole number of blocks
    manager.allocate(same)
    assert same.num_computed_tokens == 4 and same.block_table[0] == a.block_table[0]
    assert same.block_table[1] != a.block_table[1]


def test_freed_blocks_keep_their_content_until_reused():
    manager = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    manager.allocate(a)
    computed(manager, a)
    blocks = list(a.block_table)
    manager.free(a)
    assert manager.num_free_blocks == 4
    again = seq([1, 2, 3, 4, 5, 6])
    # 3 blocks: 2 revived from the free queue + 1 fresh, out of 4 free.
    assert manager.can_allocate(again)
    manager.allocate(again)
    assert again.block_table[:2] == blocks[:2] and again.num_computed_tokens == 4
    assert manager.num_free_blocks == 1


def test_can_allocate_counts_revived_cached_blocks():
    manager = BlockManager(num_blocks=3, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    manager.allocate(a)
    computed(manager, a)
    manager.free(a)
    holder = seq([7, 7, 7, 7])  # takes 2 blocks: the uncached one and one cached (LRU) block
    manager.allocate(holder)
    assert manager.num_free_blocks == 1
    b = seq([1, 2, 3, 4, 5, 6])  # needs 3 blocks, only 1 free: a's surviving cached block is one of them
    assert not manager.can_allocate(b)


def test_eviction_takes_uncached_blocks_first_then_the_tails_of_sequences():
    manager = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5])  # 3 blocks: two full (cached) + one partial (not cached)
    manager.allocate(a)
    computed(manager, a)
    head, tail, partial = a.block_table
    manager.free(a)
    other = seq([9, 9])
    manager.allocate(other)
    assert other.block_table[0] in (partial, 3), "a block with nothing cached goes first"
    more = seq([8, 8, 8, 8])
    manager.allocate(more)
    assert tail in more.block_table and head not in more.block_table, "the tail of a sequence is evicted before its head"
    assert manager.cached_prefix(seq([1, 2, 3, 4, 5])) == [head]


def test_the_same_prefix_computed_twice_is_cached_once():
    manager = BlockManager(num_blocks=8, block_size=2)
    a, b = seq([1, 2, 3]), seq([1, 2, 3])
    manager.allocate(a)
    manager.allocate(b)  # before a is computed: no hit
    assert b.num_computed_tokens == 0 and a.block_table[0] != b.block_table[0]
    computed(manager, a)
    computed(manager, b)
    assert manager.cached_prefix(seq([1, 2, 9])) == [a.block_table[0]]
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 8 and all(block.ref_count == 0 for block in manager.blocks)


def test_prefix_caching_off_never_hits():
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = seq([1, 2, 3, 4, 5])
    manager.allocate(a)
    computed(manager, a)
    b = seq([1, 2, 3, 4, 5])
    manager.allocate(b)
    assert b.num_computed_tokens == 0 and not set(a.block_table) & set(b.block_table)


def test_decode_takes_a_new_block_only_at_a_boundary():
    manager = BlockManager(num_blocks=2, block_size=2)
    a = seq([1, 2, 3])
    manager.allocate(a)
    assert not manager.needs_new_block(a)
    a.token_ids.append(4)
    assert not manager.needs_new_block(a)  # 4 tokens fit 2 blocks
    a.token_ids.append(5)
    assert manager.needs_new_block(a) and not manager.can_append(a)  # no free block left
    manager.free(a)
    b = seq([1])
    manager.allocate(b)
    b.token_ids.extend([2, 3])
    assert manager.can_append(b)
    manager.append_slot(b)
    assert len(b.block_table) == 2


def test_reset_prefix_cache_forgets_only_when_no_page_is_held():
    manager = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))
    manager.allocate(a)
    computed(manager, a)
    assert not manager.reset_prefix_cache(), "a running sequence holds cached pages"
    assert manager.cached_prefix(seq([*range(8), 5])) == a.block_table[:2]
    manager.free(a)
    assert manager.reset_prefix_cache()
    again = seq(range(10))
    assert manager.cached_prefix(again) == []
    manager.allocate(again)
    assert again.num_computed_tokens == 0 and manager.num_free_blocks == 5
