"""The scheduler on its own: token budget, chunked prefill, max_num_seqs, preemption by recompute.

A step is simulated without a model: the scheduled tokens count as computed, and every sequence whose
last token was computed gets a new token (what sampling would append).
"""

from __future__ import annotations

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, prefix_caching=True):
    return Scheduler(BlockManager(num_blocks, block_size, prefix_caching), max_num_seqs, budget)


def add(scheduler: Scheduler, seq_id: int, tokens) -> Sequence:
    seq = Sequence(seq_id, list(tokens), SamplingParams(), seed=0)
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler, next_token: int = 7):
    batch = scheduler.schedule()
    ends = [seq.num_computed_tokens + n == seq.num_tokens for seq, n in zip(batch.seqs, batch.num_new_tokens)]
    scheduler.commit(batch)
    for seq, samples in zip(batch.seqs, ends):
        if samples:
            seq.token_ids.append(next_token)
    return batch


def plan(batch):
    return [(seq.seq_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)]


def test_prefill_is_chunked_under_the_token_budget():
    scheduler = make(budget=5)
    a = add(scheduler, 0, range(12))
    b = add(scheduler, 1, range(100, 103))
    steps = [step(scheduler) for _ in range(4)]
    assert [s.is_prefill for s in steps] == [True, True, True, False]
    assert [plan(s) for s in steps] == [[(0, 5)], [(0, 5)], [(0, 2), (1, 3)], [(0, 1), (1, 1)]]
    assert all(s.num_tokens <= 5 for s in steps)
    assert a.num_output_tokens == 2 and b.num_output_tokens == 2  # the chunk that reaches the end samples


def test_waiting_prompts_are_prefilled_before_running_ones_decode():
    scheduler = make()
    add(scheduler, 0, range(4))
    step(scheduler)
    add(scheduler, 1, range(10, 13))
    batch = step(scheduler)
    assert batch.is_prefill and plan(batch) == [(1, 3)]
    batch = step(scheduler)
    assert not batch.is_prefill and plan(batch) == [(0, 1), (1, 1)]


def test_max_num_seqs_limits_admission():
    scheduler = make(max_num_seqs=2)
    seqs = [add(scheduler, i, range(i, i + 3)) for i in range(3)]
    assert plan(step(scheduler)) == [(0, 3), (1, 3)]
    assert plan(step(scheduler)) == [(0, 1), (1, 1)]  # seq 2 waits: two are running
    scheduler.finish(seqs[0])
    assert seqs[0].status is SequenceStatus.FINISHED
    assert plan(step(scheduler)) == [(2, 3)]


def test_admission_waits_for_blocks_in_request_order():
    scheduler = make(num_blocks=4, block_size=4)
    add(scheduler, 0, range(9))  # 3 blocks
    add(scheduler, 1, range(20, 25))  # 2 blocks: does not fit next to seq 0
    add(scheduler, 2, [1])  # 1 block: would fit, but must not overtake seq 1
    assert plan(step(scheduler)) == [(0, 9)]
    assert [s.seq_id for s in scheduler.waiting] == [1, 2]


def test_preemption_frees_the_newest_and_recomputes_it_later():
    scheduler = make(num_blocks=4, block_size=2)
    a = add(scheduler, 0, [1, 2, 3])
    b = add(scheduler, 1, [4, 5, 6])
    step(scheduler)  # both prefill (2 blocks each, all 4 used) and sample: 4 tokens each
    step(scheduler)  # decode: the 4th token fits the 2nd block; each samples a 5th
    batch = step(scheduler)  # decode of the 5th token needs a 3rd block: b, the newest, makes room
    assert plan(batch) == [(0, 1)]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert [s.seq_id for s in scheduler.waiting] == [1]
    b_tokens = list(b.token_ids)
    scheduler.finish(a)
    # b is readmitted. a's new block was b's tail block (evicted first); b's head block is still
    # cached, so 2 of b's 5 tokens are reused and 3 recompute.
    batch = step(scheduler)
    assert batch.is_prefill and plan(batch) == [(1, 3)]
    assert b.num_computed_tokens == 5 and b.token_ids[:5] == b_tokens and b.num_tokens == 6
    assert b.num_cached_tokens == 0, "num_cached_tokens reports the first admission only"


def test_the_newest_sequence_preempts_itself_when_only_it_needs_a_block():
    scheduler = make(num_blocks=3, block_size=4)
    a = add(scheduler, 0, [1, 2, 3, 4, 5])  # 2 blocks, room for 8 tokens
    b = add(scheduler, 1, [1, 2, 3])  # 1 block, room for 4
    step(scheduler)  # a: 6 tokens, b: 4; all 3 blocks used
    assert plan(step(scheduler)) == [(0, 1), (1, 1)]  # a: 7 tokens, b: 5
    batch = step(scheduler)  # a's 7th token fits; b's 5th needs a 5th slot: nothing older to take it from
    assert plan(batch) == [(0, 1)]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and a.status is SequenceStatus.RUNNING
    assert scheduler.block_manager.num_free_blocks == 1


def test_a_running_request_takes_back_blocks_held_for_a_tier_load_before_preempting():
    scheduler = make(num_blocks=4, block_size=4, max_num_seqs=2)
    runner = add(scheduler, 0, range(4))  # one full block; its next token needs a second
    step(scheduler)  # prefilled: 1 block held, then its first token
    bm = scheduler.block_manager
    held = bm.take_blocks(bm.num_free_blocks)  # a waiting request's tier load holds every other block
    released = []

    class Tiers:
        def admissible(self, seq):
            return False

        def reserved_blocks(self, seq):
            return 0  # its copy is in flight: it waits for no free block

        def release_loads(self, look_again=False):
            if not held:
                return 0
            bm.release_loaded(held)
            released.extend(held)
            held.clear()
            return len(released)

    scheduler.tiers = Tiers()
    add(scheduler, 1, range(50, 58))  # the waiting request
    batch = step(scheduler)
    assert plan(batch) == [(0, 1)] and released and scheduler.num_preemptions == 0 and runner.status is SequenceStatus.RUNNING
