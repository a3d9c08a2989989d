"""Deterministic mode on the reference backend, end to end (the embedded tiny V3 with a 512-token
vocabulary, float32): a
request's logits are bit-identical at every step whether it runs alone or among 3, 17 or 64
other requests, with its prefill chunked, or after a prefix-cache hit; 200 seeded completions at
temperature 1 spread over differently composed batches are identical. The same checks without
deterministic mode show the logits moving, so the batches do exercise what the mode fixes."""

from __future__ import annotations

import pytest

from engine.determinism import SMALL_VOCAB, ProbeLogits, differing_steps, neighbour_prompts, run_probe, write_small_checkpoint

PROBE = list(range(100, 137))  # 37 tokens: two full 16-token blocks for the prefix cache
STEPS = 6
VOCAB = SMALL_VOCAB


def _llm(checkpoint, num_kv_blocks_override: int = 512, **kwargs):
    from deepinfer import LLM

    return LLM(model=str(checkpoint), backend="reference", dtype="float32", announce=False, num_kv_blocks=num_kv_blocks_override, **kwargs)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_small_checkpoint(tmp_path_factory.mktemp("small") / "tiny-v3-small-vocab")


@pytest.fixture(scope="module")
def plain(checkpoint):
    llm = _llm(checkpoint, deterministic=True, enable_prefix_caching=False)
    return llm, ProbeLogits(llm)


@pytest.fixture(scope="module")
def alone(plain):
    llm, recorder = plain
    return run_probe(llm, recorder, PROBE, [], STEPS)


@pytest.mark.parametrize("neighbours", [3, 17, 64])
def test_logits_do_not_depend_on_the_batch(plain, alone, neighbours):
    llm, recorder = plain
    steps, tokens, _ = run_probe(llm, recorder, PROBE, neighbour_prompts(neighbours, VOCAB, seed=neighbours), STEPS)
    assert len(steps) == STEPS
    assert differing_steps(alone[0], steps) == []
    assert tokens == alone[1]


def test_chunked_prefill_gives_the_same_logits(checkpoint, alone):
    llm = _llm(checkpoint, deterministic=True, enable_prefix_caching=False, max_num_batched_tokens=8)
    recorder = ProbeLogits(llm)
    steps, tokens, _ = run_probe(llm, recorder, PROBE, neighbour_prompts(17, VOCAB, seed=5), STEPS)
    assert differing_steps(alone[0], steps) == []
    assert tokens == alone[1]


def test_a_prefix_hit_gives_the_same_logits(checkpoint, alone):
    from deepinfer import SamplingParams

    llm = _llm(checkpoint, deterministic=True)
    recorder = ProbeLogits(llm)
    # Another request with the probe's first 32 tokens fills the prefix cache.
    llm.generate([{"prompt_token_ids": PROBE[:32] + [7, 8, 9]}], SamplingParams(max_tokens=1), use_tqdm=False)
    steps, tokens, cached = run_probe(llm, recorder, PROBE, neighbour_prompts(3, VOCAB, seed=9), STEPS)
    assert cached == 32
    assert differing_steps(alone[0], steps) == []
    assert tokens == alone[1]


def test_seeded_sampling_is_identical_over_200_completions(plain):
    from deepinfer import SamplingParams

    llm, _ = plain
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=4, ignore_eos=True)
    completions = []
    # (probes, neighbours) per batch: 200 probes in batches of different sizes and mixes.
    for i, (probes, others) in enumerate([(1, 0), (3, 5), (16, 20), (60, 4), (120, 0)]):
        prompts = [{"prompt_token_ids": PROBE} for _ in range(probes)] + neighbour_prompts(others, VOCAB, seed=100 + i)
        greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        outs = llm.generate(prompts, [params] * probes + [greedy] * others, use_tqdm=False)
        completions += [o.outputs[0].token_ids for o in outs[:probes]]
    assert len(completions) == 200
    assert all(c == completions[0] for c in completions), sorted({tuple(c) for c in completions})


def test_without_the_mode_the_logits_move(checkpoint):
    """The control: the same batches in the default mode change the probe's logits (by ~1e-6)."""
    llm = _llm(checkpoint, enable_prefix_caching=False)
    recorder = ProbeLogits(llm)
    alone_steps, _, _ = run_probe(llm, recorder, PROBE, [], STEPS)
    moved = [differing_steps(alone_steps, run_probe(llm, recorder, PROBE, neighbour_prompts(n, VOCAB, seed=n), STEPS)[0]) for n in (17, 64)]
    assert any(moved)


@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory):
    return write_small_checkpoint(tmp_path_factory.mktemp("small_v4") / "tiny-v4-small-vocab", "deepseek_v4")


V4_PROBE = list(range(100, 300))  # past the 128-token window, and one complete 128-token compressed entry


def test_deepseek_v4_logits_do_not_depend_on_batching_chunking_or_a_prefix_hit(v4_checkpoint):
    llm = _llm(v4_checkpoint, deterministic=True, enable_prefix_caching=False)
    recorder = ProbeLogits(llm)
    want, tokens, _ = run_probe(llm, recorder, V4_PROBE, [], 3)
    got = run_probe(llm, recorder, V4_PROBE, neighbour_prompts(5, VOCAB, seed=3, lengths=(2, 40)), 3)
    assert (differing_steps(want, got[0]), got[1]) == ([], tokens)

    chunked = _llm(v4_checkpoint, deterministic=True, max_num_batched_tokens=48)
    recorder = ProbeLogits(chunked)
    got = run_probe(chunked, recorder, V4_PROBE, neighbour_prompts(3, VOCAB, seed=4, lengths=(2, 40)), 3)
    assert (differing_steps(want, got[0]), got[1]) == ([], tokens)
    # The same engine again: the probe's full blocks come from the prefix cache (SWA bounded replay).
    got = run_probe(chunked, recorder, V4_PROBE, [], 3)
    assert got[2] > 0
    assert (differing_steps(want, got[0]), got[1]) == ([], tokens)


def test_a_full_cache_delays_admission_instead_of_preempting(checkpoint, alone):
    """With 24 pages for 20 requests the default mode preempts (and recomputes) requests; the
    deterministic one admits a request only when its pages to its last token are free, so none is
    preempted and the probe's logits stay its solo run's."""
    from deepinfer import SamplingParams

    neighbours = neighbour_prompts(19, VOCAB, seed=21, lengths=(20, 40))
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True) for _ in neighbours]
    default = _llm(checkpoint, enable_prefix_caching=False, num_kv_blocks_override=24)
    assert sum(o.metrics["num_preemptions"] for o in default.generate(neighbours, params, use_tqdm=False)) > 0
    llm = _llm(checkpoint, deterministic=True, enable_prefix_caching=False, num_kv_blocks_override=24)
    recorder = ProbeLogits(llm)
    steps, tokens, _ = run_probe(llm, recorder, PROBE, neighbours, STEPS)
    assert differing_steps(alone[0], steps) == [] and tokens == alone[1]
    assert llm.engine.scheduler.num_preemptions == 0
