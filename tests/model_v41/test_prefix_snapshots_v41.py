"""DeepSeek-V4.1 prefix hits that reuse the paged history exactly (deepinfer/engine/state_snapshots.py): the tiny oracle
checkpoint, reference backend (blocks of 16 tokens), float32, with the decoder SWA bounded replay on and off.

A hit shares the cached blocks, restores the state-slot snapshot filed at its last block (window rings, open-group
projections, Engram's ids, DSpark's context) and computes only the tokens after it; its greedy tokens are those of
a one-shot generation without prefix caching. With the replay on a hit stops at the prompt's decoder tail (its
start, `decoder_from`), so what the decoder computes is the one-shot prefill's. Covered: a long shared prefix (the
computed-token count), a multi-turn conversation (snapshots taken as decode crosses a boundary), chunked prefill,
preemption, eviction of snapshots (recomputation), and the shared blocks of another request left untouched.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.state_snapshots import StateSnapshots

from model_v41.tiny_v41 import write_oracle_checkpoint

BLOCK = 16  # the reference backend's token block
TAIL = 21  # the oracle checkpoint's bounded-replay tail: window 16 + DSpark block 5
NEW = 6
REPLAY = pytest.mark.parametrize("replay", [True, False], ids=["bounded_replay", "every_layer"])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_oracle_checkpoint(tmp_path_factory.mktemp("v41") / "oracle")


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(folder, replay: bool, **engine) -> LLM:
    return LLM(model=str(folder), backend="reference", dtype="float32", max_model_len=256, announce=False, swa_bounded_replay=replay, **engine)


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int = NEW):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _one_shot(folder, replay: bool, prompts: list[list[int]], max_tokens: int = NEW) -> list[list[int]]:
    outs = _run(_llm(folder, replay, enable_prefix_caching=False, max_num_seqs=1), prompts, max_tokens)
    return [list(o.outputs[0].token_ids) for o in outs]


@REPLAY
def test_a_long_shared_prefix_computes_only_the_tokens_after_its_boundary(folder, replay):
    """A 100-token prompt ends a chunk (and files a snapshot) at its last block boundary, 96; a 130-token prompt
    that extends it hits 96 tokens and computes 34, giving the one-shot tokens."""
    first = _prompt(100, 1)
    extended = first + _prompt(30, 2)
    llm = _llm(folder, replay)
    _run(llm, [first])
    before = llm.engine.num_prompt_tokens_computed
    hit = _run(llm, [extended])[0]
    assert hit.num_cached_tokens == 96
    assert llm.engine.num_prompt_tokens_computed - before == len(extended) - 96
    assert list(hit.outputs[0].token_ids) == _one_shot(folder, replay, [extended])[0]


def test_with_the_bounded_replay_a_hit_stops_at_the_prompts_decoder_tail(folder):
    """A 110-token prompt's tail starts at 89: the snapshot at 96 is past it, so the hit reaches the one filed at
    the first prompt's own tail boundary (64, where its chunk also ended); with the replay off it reaches 96."""
    first = _prompt(100, 1)
    extended = first + _prompt(10, 3)
    for replay, cached in ((True, 64), (False, 96)):
        llm = _llm(folder, replay)
        _run(llm, [first])
        hit = _run(llm, [extended])[0]
        assert hit.num_cached_tokens == cached
        assert list(hit.outputs[0].token_ids) == _one_shot(folder, replay, [extended])[0]


@REPLAY
def test_a_multi_turn_conversation_hits_where_the_last_turn_decoded(folder, replay):
    """Turn 1: 70 prompt tokens and 40 generated (decode files snapshots at 80, 96, 112 ... as it crosses them);
    turn 2 = turn 1's tokens + 30 new ones hits the last boundary turn 1 computed: 96 (109 computed, 112 not)."""
    prompt = _prompt(70, 4)
    llm = _llm(folder, replay)
    turn1 = _run(llm, [prompt], max_tokens=40)[0]
    turn2 = prompt + list(turn1.outputs[0].token_ids) + _prompt(30, 5)
    hit = _run(llm, [turn2])[0]
    assert hit.num_cached_tokens == 96
    assert list(hit.outputs[0].token_ids) == _one_shot(folder, replay, [turn2])[0]


@REPLAY
def test_chunked_prefill_after_a_hit_gives_the_one_shot_tokens(folder, replay):
    first = _prompt(100, 1)
    extended = first + _prompt(40, 6)
    llm = _llm(folder, replay, max_num_batched_tokens=16, max_num_seqs=2)
    _run(llm, [first])
    hit = _run(llm, [extended])[0]
    assert hit.num_cached_tokens == 96
    assert list(hit.outputs[0].token_ids) == _one_shot(folder, replay, [extended])[0]


def test_preempted_requests_that_hit_give_the_one_shot_tokens(folder):
    """Twelve blocks for three requests sharing a 64-token prefix: some are preempted and readmitted (hitting
    their own and each other's snapshots)."""
    shared = _prompt(64, 7)
    prompts = [shared + _prompt(n, 8 + n) for n in (30, 35, 40)]
    llm = _llm(folder, True, num_kv_blocks=12, max_num_seqs=3)
    _run(llm, [shared + _prompt(30, 9)], max_tokens=1)  # files the shared prefix's snapshot at 64
    outs = _run(llm, prompts, max_tokens=12)
    assert sum(o.metrics["num_preemptions"] for o in outs) >= 1
    assert any(o.num_cached_tokens for o in outs)
    assert [list(o.outputs[0].token_ids) for o in outs] == _one_shot(folder, True, prompts, max_tokens=12)


def test_an_evicted_snapshot_means_recomputation_and_the_same_tokens(folder, monkeypatch):
    """A pool of one snapshot: a second prompt's snapshot evicts the first's, so the prompt that extends the first
    hits nothing (its blocks are still cached) and is computed whole."""
    import deepinfer.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "snapshot_capacity", lambda *args: 1)
    first = _prompt(100, 1)
    extended = first + _prompt(30, 2)
    llm = _llm(folder, True)
    assert llm.engine.block_manager.snapshots.capacity == 1
    _run(llm, [first])
    _run(llm, [_prompt(50, 10)])
    before = llm.engine.num_prompt_tokens_computed
    out = _run(llm, [extended])[0]
    assert out.num_cached_tokens == 0 and llm.engine.num_prompt_tokens_computed - before == len(extended)
    assert list(out.outputs[0].token_ids) == _one_shot(folder, True, [extended])[0]


def test_hits_never_write_the_blocks_they_share(folder):
    """The cached blocks of a prefix hold the same bytes before and after requests that hit them ran beside each
    other, and those requests give the one-shot tokens."""
    first = _prompt(100, 1)
    llm = _llm(folder, False)
    _run(llm, [first])
    manager, caches = llm.engine.block_manager, llm.engine.runner.kv_caches
    shared = [manager.cached[Sequence(0, first, SamplingParams(), 0).block_hash(i, BLOCK)] for i in range(6)]
    paged = [t for layer in caches.layers for t in (layer.entries, layer.index_keys) if t is not None]
    before = [t[shared].clone() for t in paged]
    prompts = [first + _prompt(20, 11), first + _prompt(40, 12)]
    outs = _run(llm, prompts)
    assert [o.num_cached_tokens for o in outs] == [96, 96]
    assert all(torch.equal(t[shared], b) for t, b in zip(paged, before))
    assert [list(o.outputs[0].token_ids) for o in outs] == _one_shot(folder, False, prompts)


def test_the_snapshot_pool_is_the_state_slot_and_counted_in_the_budget(folder):
    llm = _llm(folder, True)
    engine = llm.engine
    snapshots = engine.block_manager.snapshots
    per_snapshot = StateSnapshots.bytes_per_snapshot(snapshots.slot_tensors)
    assert per_snapshot == engine.loaded.model.state_slot_bytes()
    assert snapshots.capacity == engine.num_state_snapshots >= engine.config.max_num_seqs
    assert sum(t.numel() * t.element_size() for t in snapshots.pool) == snapshots.capacity * per_snapshot
    off = _llm(folder, True, enable_prefix_caching=False)
    assert off.engine.block_manager.snapshots is None and off.engine.num_state_snapshots == 0


def test_a_hit_reaches_only_the_last_block_whose_snapshot_is_kept():
    """The block manager alone: three cached blocks, snapshots of the first and third; the pool's LRU."""
    slot = torch.arange(4.0).view(2, 2)  # two state slots of two values
    snapshots = StateSnapshots([slot], capacity=2)
    manager = BlockManager(8, 4, num_state_slots=2)
    manager.keep_snapshots(snapshots)
    writer = Sequence(0, list(range(13)), SamplingParams(), 0)
    manager.allocate(writer)
    for computed in (4, 8, 12):  # each boundary's state: its position
        slot[writer.state_slot] = computed
        old, writer.num_computed_tokens = writer.num_computed_tokens, computed
        manager.commit(writer, old)
    assert len(snapshots) == 2  # a pool of two: the snapshot at 4 was overwritten by the one at 12
    reader = Sequence(1, list(range(13)) + [99], SamplingParams(), 0)
    assert manager.cached_prefix(reader) == writer.block_table[:3]
    manager.allocate(reader)
    assert reader.num_computed_tokens == reader.num_cached_kv == 12 and torch.equal(slot[reader.state_slot], torch.full((2,), 12.0))
    manager.hit_limit = lambda seq: 11  # a hit may cover at most 11 positions: two blocks
    assert manager.cached_prefix(Sequence(2, list(range(14)), SamplingParams(), 0)) == writer.block_table[:2]
    snapshots.drop(writer.block_hash(1, 4))  # no snapshot at 8 (nor at 4): nothing is usable
    assert manager.cached_prefix(Sequence(3, list(range(14)), SamplingParams(), 0)) == []
