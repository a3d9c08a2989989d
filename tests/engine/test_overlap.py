"""Overlap scheduling (deepinfer.engine.overlap), forced on over the reference backend (the CPU runs
each launch at once, so what is tested is the bookkeeping: tokens read one step late, inputs taken
from the step in flight, rows of stopped sequences dropped, steps that must wait).

Its outputs are the synchronous engine's: stops by length, stop token, EOS and stop string landing at
every step boundary, sampled requests, preemption, a queue of waiting requests, prefix hits and an
abandoned stream. Deterministic mode (batch-invariant logits) except where the batches are the same
in both: a stopped sequence's dropped row and a later admission change a step's batch, which in
default mode may move other requests' logits in the last bits (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses

import pytest

from engine.determinism import SMALL_VOCAB, neighbour_prompts, write_small_checkpoint

PROMPTS = neighbour_prompts(8, SMALL_VOCAB, seed=5, lengths=(3, 40))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_small_checkpoint(tmp_path_factory.mktemp("small") / "tiny-v3", num_hidden_layers=2)


def _llm(model, overlap, deterministic=True, **kwargs):
    from deepinfer import LLM

    kwargs.setdefault("num_kv_blocks", 256)
    return LLM(model=str(model) if model else None, backend="reference", dtype="float32", announce=False, deterministic=deterministic,
               overlap=overlap, **kwargs)  # fmt: skip


def _greedy(max_tokens=12, **kwargs):
    from deepinfer import SamplingParams

    kwargs.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def _results(outputs):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outputs]


def _both(model, prompts, params, **kwargs):
    """(synchronous results, overlapped results, the overlapped LLM)."""
    sync, ahead = _llm(model, False, **kwargs), _llm(model, True, **kwargs)
    assert sync.engine.overlap is None and ahead.engine.overlap is not None
    return _results(sync.generate(prompts, params, use_tqdm=False)), _results(ahead.generate(prompts, params, use_tqdm=False)), ahead


@pytest.fixture(scope="module")
def baseline(checkpoint):
    return [r[0] for r in _results(_llm(checkpoint, False).generate(PROMPTS, _greedy(), use_tqdm=False))]


def test_length_stops_at_every_boundary(checkpoint):
    params = [_greedy(max_tokens=i + 1) for i in range(len(PROMPTS))]
    sync, ahead, llm = _both(checkpoint, PROMPTS, params)
    assert ahead == sync
    assert [len(r[0]) for r in ahead] == list(range(1, len(PROMPTS) + 1))
    assert llm.engine.overlap.steps_ahead > 0


def test_stop_tokens_at_every_boundary(checkpoint, baseline):
    """Prompt i stops on its own greedy token number i (so at step i): the steps already launched
    behind it drop its rows."""
    params = [_greedy(stop_token_ids=[tokens[i]]) for i, tokens in enumerate(baseline)]
    sync, ahead, llm = _both(checkpoint, PROMPTS, params)
    assert ahead == sync
    for (tokens, _, reason, stop), expected in zip(ahead, baseline):
        assert reason == "stop" and tokens == expected[: expected.index(stop) + 1]
    assert llm.engine.overlap.steps_ahead > 0


def test_eos_at_every_boundary(checkpoint, baseline):
    """The EOS ids set to tokens that the prompts reach at different steps."""
    eos = {tokens[i] for i, tokens in enumerate(baseline)}
    params = _greedy(ignore_eos=False)
    sync_llm, ahead_llm = _llm(checkpoint, False), _llm(checkpoint, True)
    for llm in (sync_llm, ahead_llm):
        llm.engine.eos_token_ids = frozenset(eos)
    sync, ahead = (_results(llm.generate(PROMPTS, params, use_tqdm=False)) for llm in (sync_llm, ahead_llm))
    assert ahead == sync
    assert all(r[2] == "stop" and r[0][-1] in eos for r in ahead)
    assert len({len(r[0]) for r in ahead}) > 3  # they stop at different steps


def test_seeded_sampling(checkpoint):
    from deepinfer import SamplingParams

    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, ignore_eos=True, seed=100 + i) for i in range(len(PROMPTS))]
    sync, ahead, _ = _both(checkpoint, PROMPTS, params)
    assert ahead == sync


def test_preemption(checkpoint, baseline):
    """Few pages: the synchronous and the overlapped engine both preempt (an overlapped step that
    would preempt waits for the step in flight) and recompute, with the same tokens. Default mode
    (deterministic mode reserves every page up front and never preempts)."""
    sync_llm, ahead_llm = (_llm(checkpoint, overlap, deterministic=False, num_kv_blocks=5) for overlap in (False, True))
    params = _greedy(max_tokens=40)
    sync, ahead = (_results(llm.generate(PROMPTS, params, use_tqdm=False)) for llm in (sync_llm, ahead_llm))
    assert ahead == sync
    assert [r[0][:12] for r in ahead] == baseline
    assert sync_llm.engine.scheduler.num_preemptions > 0 and ahead_llm.engine.scheduler.num_preemptions > 0
    assert ahead_llm.engine.overlap.steps_ahead > 0


def test_waiting_queue_and_prefix_hits(checkpoint, baseline):
    """Three sequences at a time: admissions between decode steps; then the same prompts again,
    their prefixes from the cache the overlapped steps registered."""
    llm = _llm(checkpoint, True, max_num_seqs=3)
    first = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    second = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    assert [r[0] for r in _results(first)] == baseline == [r[0] for r in _results(second)]
    assert sum(o.num_cached_tokens for o in second) > 0
    assert llm.engine.overlap.steps_ahead > 0


def test_abandoned_stream(checkpoint, baseline):
    """A caller stops iterating with a step in flight: it is dropped, and the next run is unaffected."""
    llm = _llm(checkpoint, True)
    stream = llm.generate_iter(PROMPTS, [_greedy(max_tokens=2 + i) for i in range(len(PROMPTS))], use_tqdm=False)
    next(stream)
    stream.close()
    assert [r[0] for r in _results(llm.generate(PROMPTS, _greedy(), use_tqdm=False))] == baseline


def test_default_mode_same_batches(checkpoint):
    """Default mode, every request to the same length: each step's batch is the synchronous one's, so
    even logits that depend on the batch give the same tokens."""
    sync, ahead, _ = _both(checkpoint, PROMPTS, _greedy(max_tokens=9), deterministic=False)
    assert ahead == sync


def test_stop_strings_at_every_boundary():
    """The embedded tiny model (it has a tokenizer): each prompt stops on a piece of its own text."""
    prompts = ["Hello there", "The capital of France is", "1 2 3 4", "Once upon a time"]
    texts = [r[1] for r in _results(_llm(None, False).generate(prompts, _greedy(max_tokens=10), use_tqdm=False))]
    params = [_greedy(max_tokens=10, stop=[text[2 + 3 * i : 4 + 3 * i]]) for i, text in enumerate(texts) if len(text) > 4 + 3 * i]
    assert len(params) == len(prompts)
    sync, ahead, _ = _both(None, prompts, params)
    assert ahead == sync
    assert [r[2] for r in ahead].count("stop") >= 3


def test_v4(tmp_path):
    """DeepSeek-V4 (per-sequence compressor state beside the paged cache): same tokens, length and stop-token boundaries."""
    model = write_small_checkpoint(tmp_path / "tiny-v4", model_type="deepseek_v4")
    prompts = PROMPTS[:4]
    base = [r[0] for r in _results(_llm(model, False).generate(prompts, _greedy(max_tokens=8), use_tqdm=False))]
    params = [_greedy(max_tokens=8 - i, stop_token_ids=[tokens[2 * i]]) for i, tokens in enumerate(base)]
    sync, ahead, _ = _both(model, prompts, params)
    assert ahead == sync


def test_overlap_option():
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
    from deepinfer.engine.sampling_params import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="overlap must be None"):
        EngineConfig(overlap="yes").validate()
    llm = _llm(None, None)
    assert llm.engine.overlap is None  # the reference backend runs synchronously
    engine = llm.engine
    asynchronous = dataclasses.replace(engine.runtime, async_execution=True)
    assert LLMEngine(engine.loaded, asynchronous, engine.dtype, EngineConfig(deterministic=True, num_kv_blocks=64)).overlap is not None
    spec = EngineConfig(deterministic=True, num_kv_blocks=64, speculative="mtp:2", overlap=True)
    with pytest.raises(InvalidRequestError, match="overlap scheduling does not combine with speculative decoding"):
        LLMEngine(engine.loaded, engine.runtime, engine.dtype, spec)
    spec.overlap = None
    assert LLMEngine(engine.loaded, asynchronous, engine.dtype, spec).overlap is None  # auto: off with speculation
