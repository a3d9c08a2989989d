"""LLMEngine.abort: one request dropped wherever it is (queued, prefilling, decoding, with n samples
held back or running, waiting for its grammar), its KV pages back in the free pool at once, the other
requests untouched (deterministic mode: their tokens equal a run without the aborted one)."""

from __future__ import annotations

import pytest

from deepinfer import SamplingParams
from deepinfer.engine.sequence import SequenceStatus

PROMPT = list(range(5, 45))  # 3 blocks of 16


@pytest.fixture(scope="module")
def llm(cache):
    from deepinfer import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        return LLM(backend="reference", announce=False, num_kv_blocks=64, deterministic=True, max_num_seqs=2)


def params(**kwargs):
    return SamplingParams(**{"temperature": 0, "max_tokens": 6, "ignore_eos": True, **kwargs})


def run_to_end(engine, keep):
    finished = {}
    while engine.has_unfinished():
        for seq in engine.step():
            finished[seq.seq_id] = engine.make_output(seq)
    return [finished[seq.seq_id] for seq in keep]


@pytest.mark.parametrize("when", ["queued", "prefilled", "decoding"])
def test_abort_frees_blocks_and_leaves_the_rest_alone(llm, when):
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": [7, 8, 9]}], params(), use_tqdm=False)]
    other = engine.add_request([7, 8, 9], params())
    victim = engine.add_request(PROMPT, params(n=3))
    steps = {"queued": 0, "prefilled": 1, "decoding": 3}[when]
    for _ in range(steps):
        assert engine.step() == []
    if when == "decoding":
        assert victim.status is SequenceStatus.RUNNING and victim.block_table
    assert engine.abort(victim)
    assert all(s.status is SequenceStatus.FINISHED and s.finish_reason == "abort" and not s.block_table for s in victim.samples)
    assert victim not in engine.scheduler.waiting and victim not in engine.scheduler.running and not victim.held_back
    assert not engine.abort(victim)  # once
    assert [o.outputs[0].token_ids for o in run_to_end(engine, [other])] == expected
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == free  # every page back (cached ones are free to reuse)
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
    output = engine.make_output(victim)
    assert output.finished and [c.finish_reason for c in output.outputs] == ["abort"] * 3


def test_abort_a_finished_request_changes_nothing(llm):
    engine = llm.engine
    seq = engine.add_request([3, 4], params(max_tokens=1))
    run_to_end(engine, [seq])
    assert not engine.abort(seq)
    assert engine.make_output(seq).outputs[0].finish_reason == "length"


def test_abort_while_its_grammar_compiles(llm):
    engine = llm.engine
    seq = engine.add_request([3, 4, 5], params(structured_outputs={"json": {"type": "boolean"}}))
    assert engine.has_unfinished()
    assert engine.abort(seq)
    assert not engine.has_unfinished()
    assert engine.step() == []


def test_abort_looks_through_the_queue_once_whatever_n(llm):
    """Aborting a request of n queued samples removed them one by one (a search of the queue for
    each: quadratic in n, minutes for a request of a million): now one pass over the queue."""
    engine = llm.engine

    class CountingQueue(list):
        looks = 0

        def __iter__(self):
            CountingQueue.looks += 1
            return super().__iter__()

        def __contains__(self, item):
            CountingQueue.looks += 1
            return super().__contains__(item)

        def remove(self, item):
            CountingQueue.looks += 1
            super().remove(item)

    victim = engine.add_request(PROMPT, params(n=300))
    while victim.held_back:  # sample 0's prompt is in the cache: the other samples are queued
        engine.step()
    assert sum(s.status is SequenceStatus.WAITING for s in victim.samples) >= 290
    engine.scheduler.waiting = CountingQueue(engine.scheduler.waiting)
    try:
        assert engine.abort(victim)
        assert CountingQueue.looks <= 1 and not engine.scheduler.waiting
    finally:
        engine.scheduler.waiting = list(engine.scheduler.waiting)
    assert all(s.finish_reason == "abort" for s in victim.samples)
    run_to_end(engine, [])
    assert not engine.has_unfinished()
