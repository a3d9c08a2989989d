"""Parallel samples (SamplingParams.n, deepinfer.engine.parallel_samples) on the reference backend
with a small float32 checkpoint: n outputs per prompt with their indices, distinct at temperature 1,
repeated under the seed (sample 0 is the n=1 run), greedy samples all equal to the n=1 output, the
prompt's full KV blocks shared by reference (block counts and ref counts while the samples run),
stops per sample, a waiting queue, overlap scheduling, mixed steps, prefix caching off, refusals.

Deterministic mode (batch-invariant logits, prefix hits included) wherever outputs of differently
batched runs are compared.
"""

from __future__ import annotations

import pytest

from engine.determinism import SMALL_VOCAB, neighbour_prompts, write_small_checkpoint

PROMPTS = neighbour_prompts(5, SMALL_VOCAB, seed=20, lengths=(3, 40))
LONG_PROMPT = {"prompt_token_ids": [(7 * i) % (SMALL_VOCAB - 2) + 2 for i in range(40)]}  # 2 full blocks of 16 + 8 tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_small_checkpoint(tmp_path_factory.mktemp("small") / "tiny-v3", num_hidden_layers=2)


def _llm(model, deterministic=True, **kwargs):
    from deepinfer import LLM

    kwargs.setdefault("num_kv_blocks", 128)
    return LLM(model=str(model), backend="reference", dtype="float32", announce=False, deterministic=deterministic, **kwargs)


def _params(**kwargs):
    from deepinfer import SamplingParams

    kwargs.setdefault("ignore_eos", True)
    kwargs.setdefault("max_tokens", 6)
    return SamplingParams(**kwargs)


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def sampled(checkpoint):
    """(n=1 tokens, n=4 tokens, the n=4 tokens of a second LLM): default seeds, temperature 1."""
    one = _tokens(_llm(checkpoint).generate(PROMPTS, _params(temperature=1.0), use_tqdm=False))
    four = [_tokens(_llm(checkpoint).generate(PROMPTS, _params(temperature=1.0, n=4), use_tqdm=False)) for _ in range(2)]
    return one, four[0], four[1]


def test_n_outputs_with_indices_distinct_at_temperature_1(checkpoint):
    outputs = _llm(checkpoint).generate(PROMPTS, _params(temperature=1.0, n=4), use_tqdm=False)
    assert len(outputs) == len(PROMPTS)
    for output, prompt in zip(outputs, PROMPTS):
        assert output.finished and output.prompt_token_ids == prompt["prompt_token_ids"]
        assert [c.index for c in output.outputs] == [0, 1, 2, 3]
        assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in output.outputs)
        assert len({tuple(c.token_ids) for c in output.outputs}) == 4, output.outputs


def test_seeded_rerun_repeats_and_sample_0_is_the_n1_run(sampled):
    one, four, again = sampled
    assert four == again
    assert [samples[0] for samples in four] == [samples[0] for samples in one]


def test_request_seed_gives_the_samples(checkpoint):
    llm = _llm(checkpoint)
    first = _tokens(llm.generate(PROMPTS[:2], _params(temperature=1.0, n=3, seed=99), use_tqdm=False))
    second = _tokens(llm.generate(PROMPTS[:2], _params(temperature=1.0, n=3, seed=99), use_tqdm=False))  # other request indices
    assert first == second
    assert first[0] != _tokens(llm.generate(PROMPTS[:1], _params(temperature=1.0, n=3, seed=100), use_tqdm=False))[0]


def test_greedy_samples_equal_the_n1_output(checkpoint):
    llm = _llm(checkpoint)
    one = _tokens(llm.generate(PROMPTS, _params(temperature=0.0, max_tokens=8), use_tqdm=False))
    three = _tokens(llm.generate(PROMPTS, _params(temperature=0.0, max_tokens=8, n=3), use_tqdm=False))
    assert three == [samples * 3 for samples in one]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_samples_share_the_prompts_full_blocks(checkpoint, prefix_caching):
    llm = _llm(checkpoint, enable_prefix_caching=prefix_caching)
    engine, bm = llm.engine, llm.engine.block_manager
    assert engine.block_size == 16
    head = engine.add_request(LONG_PROMPT["prompt_token_ids"], _params(temperature=1.0, n=3, max_tokens=5))
    children = head.samples[1:]
    assert [s.sample_index for s in head.samples] == [0, 1, 2] and len({s.seq_id for s in head.samples}) == 3
    assert engine.scheduler.waiting == [head]  # the other samples are held back, not queued
    engine.step()  # sample 0's prompt prefill (and its first token)
    assert head.num_output_tokens == 1 and head.held_back == []
    assert engine.scheduler.waiting == children and bm.num_free_blocks == bm.num_blocks - 3
    engine.step()  # the samples are admitted
    assert all(c.status.value == "running" for c in children)
    prompt_blocks = head.block_table[:2]
    if prefix_caching:
        assert all(c.block_table[:2] == prompt_blocks for c in children)
        assert [bm.blocks[b].ref_count for b in prompt_blocks] == [3, 3]
        assert all(c.num_cached_tokens == 32 for c in children)
        assert bm.num_free_blocks == bm.num_blocks - 3 - 2  # one fresh block (the last 8 prompt tokens) each
    else:
        assert all(set(c.block_table).isdisjoint(head.block_table) for c in children)
        assert [bm.blocks[b].ref_count for b in prompt_blocks] == [1, 1]
        assert bm.num_free_blocks == bm.num_blocks - 3 * 3
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert finished == [head]  # the request is reported once, with every sample
    output = engine.make_output(head)
    assert output.finished and [len(c.token_ids) for c in output.outputs] == [5, 5, 5]
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_caching_off_gives_the_same_samples(checkpoint):
    params = _params(temperature=1.0, n=3, seed=5)
    on = _tokens(_llm(checkpoint).generate([LONG_PROMPT, *PROMPTS[:2]], params, use_tqdm=False))
    off = _tokens(_llm(checkpoint, enable_prefix_caching=False).generate([LONG_PROMPT, *PROMPTS[:2]], params, use_tqdm=False))
    assert on == off


def test_stops_per_sample(checkpoint):
    llm = _llm(checkpoint)
    free = _tokens(llm.generate([LONG_PROMPT], _params(temperature=1.0, n=4, seed=3, max_tokens=10), use_tqdm=False))[0]
    stop = free[1][2]  # sample 1 stops at its third token; the others where (if) they draw it
    outputs = llm.generate([LONG_PROMPT], _params(temperature=1.0, n=4, seed=3, max_tokens=10, stop_token_ids=[stop]), use_tqdm=False)[0].outputs
    for unstopped, out in zip(free, outputs):
        end = unstopped.index(stop) + 1 if stop in unstopped else len(unstopped)
        assert out.token_ids == unstopped[:end]
        assert (out.finish_reason, out.stop_reason) == (("stop", stop) if stop in unstopped else ("length", None))
    assert len(outputs[1].token_ids) <= 3
    lengths = [c.token_ids for c in llm.generate([LONG_PROMPT], _params(temperature=1.0, n=2, seed=3, max_tokens=4), use_tqdm=False)[0].outputs]
    assert lengths == [free[0][:4], free[1][:4]]


def test_waiting_queue_and_preemption_free_small_batches(checkpoint):
    params = _params(temperature=1.0, n=3, seed=8)
    wide = _tokens(_llm(checkpoint).generate(PROMPTS, params, use_tqdm=False))
    narrow_llm = _llm(checkpoint, max_num_seqs=2, max_num_batched_tokens=24)
    narrow = _tokens(narrow_llm.generate(PROMPTS, params, use_tqdm=False))
    assert narrow == wide


def test_overlap_scheduling(checkpoint):
    params = _params(temperature=1.0, n=3, seed=4, max_tokens=7)
    sync = _llm(checkpoint, overlap=False)
    ahead = _llm(checkpoint, overlap=True, max_num_seqs=4)
    assert sync.engine.overlap is None and ahead.engine.overlap is not None
    expected = _tokens(sync.generate(PROMPTS, params, use_tqdm=False))
    assert _tokens(ahead.generate(PROMPTS, params, use_tqdm=False)) == expected
    stopped = _params(temperature=1.0, n=3, seed=4, max_tokens=7, stop_token_ids=[expected[0][1][3]])
    assert _tokens(ahead.generate(PROMPTS, stopped, use_tqdm=False)) == _tokens(sync.generate(PROMPTS, stopped, use_tqdm=False))


def test_mixed_steps(checkpoint):
    llm = _llm(checkpoint, deterministic=False, mixed_steps=True, max_num_batched_tokens=32)
    assert llm.engine.scheduler.mixed_steps
    params = _params(temperature=1.0, n=3, seed=6)
    first = llm.generate([LONG_PROMPT, *PROMPTS], params, use_tqdm=False)
    for output in first:
        assert [c.index for c in output.outputs] == [0, 1, 2] and all(len(c.token_ids) == 6 for c in output.outputs)
    again = _llm(checkpoint, deterministic=False, mixed_steps=True, max_num_batched_tokens=32).generate([LONG_PROMPT, *PROMPTS], params, use_tqdm=False)
    assert _tokens(again) == _tokens(first)


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2", 16385, 2**63])  # above vLLM's bound, 16384: a request of 2**63 samples took the server down
def test_bad_n(n):
    from deepinfer import SamplingParams
    from deepinfer.engine.sampling_params import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=r"^SamplingParams: n must be an integer in \[1, 16384\], got "):
        SamplingParams(n=n)


def test_one_token_samples_start_after_sample_0_has_finished(checkpoint):
    llm = _llm(checkpoint)
    output = llm.generate([LONG_PROMPT], _params(temperature=1.0, n=3, seed=1, max_tokens=1), use_tqdm=False)[0]
    assert output.finished and [len(c.token_ids) for c in output.outputs] == [1, 1, 1]
    assert output.outputs[0].token_ids == llm.generate([LONG_PROMPT], _params(temperature=1.0, seed=1, max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_preemption_under_a_small_cache(checkpoint):
    llm = _llm(checkpoint, deterministic=False, num_kv_blocks=8)  # 3 samples of 40 + 30 tokens need 15 pages unshared
    outputs = llm.generate([LONG_PROMPT, PROMPTS[0]], _params(temperature=1.0, n=3, seed=2, max_tokens=30), use_tqdm=False)
    assert all(o.finished and [len(c.token_ids) for c in o.outputs] == [30] * 3 for o in outputs)
    assert sum(o.metrics["num_preemptions"] for o in outputs) > 0
    assert llm.engine.block_manager.num_free_blocks == 8 and not llm.engine.has_unfinished()


def test_an_abandoned_stream_drops_every_sample(checkpoint):
    llm = _llm(checkpoint)
    stream = llm.generate_iter([LONG_PROMPT, *PROMPTS], _params(temperature=1.0, n=3, max_tokens=5), use_tqdm=False)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished() and llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    outputs = llm.generate(PROMPTS[:2], _params(temperature=1.0, n=2, max_tokens=3), use_tqdm=False)
    assert [[len(c.token_ids) for c in o.outputs] for o in outputs] == [[3, 3], [3, 3]]
