"""Mixed steps: a prefill step also decodes one token of every running request (the scheduler's
mixed_steps), on the reference backend.

A long prompt no longer stalls the requests already generating; the tokens are those of the engine
without mixing (the small tiny V3 in float32: a decode token on the prefill path differs from the
decode path's by rounding only, which moves no greedy token here), with chunked prefill, a waiting
queue, preemption, prefix hits, stops, and DeepSeek-V4.
"""

from __future__ import annotations

import pytest

from engine.determinism import SMALL_VOCAB, neighbour_prompts, write_small_checkpoint

PROMPTS = neighbour_prompts(10, SMALL_VOCAB, seed=5, lengths=(3, 90))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_small_checkpoint(tmp_path_factory.mktemp("small") / "tiny-v3", num_hidden_layers=2)


def _llm(model, mixed, **kwargs):
    from deepinfer import LLM

    kwargs.setdefault("num_kv_blocks", 256)
    kwargs.setdefault("max_num_batched_tokens", 32)
    return LLM(model=str(model), backend="reference", dtype="float32", announce=False, mixed_steps=mixed, **kwargs)


def _greedy(max_tokens=12, **kwargs):
    from deepinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _both(model, prompts, params, **kwargs):
    plain, mixed = _llm(model, False, **kwargs), _llm(model, True, **kwargs)
    return _tokens(plain.generate(prompts, params, use_tqdm=False)), _tokens(mixed.generate(prompts, params, use_tqdm=False)), plain, mixed


def test_same_tokens_fewer_steps(checkpoint):
    """Four requests at a time, prompts in 32-token chunks: admissions keep arriving while others decode."""
    plain_tokens, mixed_tokens, plain, mixed = _both(checkpoint, PROMPTS, _greedy(), max_num_seqs=4)
    assert mixed_tokens == plain_tokens
    assert mixed.engine.num_steps < plain.engine.num_steps
    assert mixed.engine.num_prompt_tokens_computed == plain.engine.num_prompt_tokens_computed == sum(len(p["prompt_token_ids"]) for p in PROMPTS)


def test_a_long_prompt_does_not_stall_decoding(checkpoint):
    """A request decoding when a 120-token prompt arrives: with mixing it gains a token in each of
    the prompt's 4 chunked-prefill steps, without it none."""
    for mixed, gained in ((True, 4), (False, 0)):
        engine = _llm(checkpoint, mixed).engine
        running = engine.add_request(PROMPTS[0]["prompt_token_ids"], _greedy(max_tokens=50))
        while running.num_output_tokens < 2:
            engine.step()
        long = engine.add_request(list(range(5, 125)), _greedy(max_tokens=3))
        before = running.num_output_tokens
        for _ in range(4):
            engine.step()
        assert long.num_computed_tokens == 120 and running.num_output_tokens - before == gained


def test_batch_layout_and_budget(checkpoint):
    """A mixed step: the decodes first, one token each, the prompt chunk in the rest of the budget."""
    engine = _llm(checkpoint, True).engine
    decoding = [engine.add_request(p["prompt_token_ids"][:5], _greedy(max_tokens=30)) for p in PROMPTS[:3]]
    while any(seq.num_output_tokens == 0 for seq in decoding):
        engine.step()
    engine.add_request(list(range(5, 105)), _greedy(max_tokens=2))
    batch = engine.schedule()
    assert batch.is_prefill and batch.num_decodes == 3
    assert batch.seqs[:3] == decoding and batch.num_new_tokens == [1, 1, 1, 29]
    assert batch.num_prompt_tokens == 29 and batch.num_tokens == 32


def test_no_mixing_when_pages_are_short(checkpoint):
    """Decodes that would need pages the free pool lacks are not mixed in (a decode step preempts as
    before); the tokens still equal the unmixed engine's."""
    plain_tokens, mixed_tokens, _, mixed = _both(checkpoint, PROMPTS, _greedy(max_tokens=30), num_kv_blocks=7)
    assert mixed_tokens == plain_tokens
    assert mixed.engine.scheduler.num_preemptions > 0


def test_prefix_hits_and_stops(checkpoint):
    baseline = _tokens(_llm(checkpoint, False).generate(PROMPTS, _greedy(), use_tqdm=False))
    llm = _llm(checkpoint, True, max_num_seqs=3)
    params = [_greedy(stop_token_ids=[tokens[i]]) for i, tokens in enumerate(baseline)]
    first = _tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    assert first == [tokens[: tokens.index(tokens[i]) + 1] for i, tokens in enumerate(baseline)]
    again = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    assert _tokens(again) == baseline and sum(o.num_cached_tokens for o in again) > 0


def test_v4(tmp_path):
    model = write_small_checkpoint(tmp_path / "tiny-v4", model_type="deepseek_v4")
    plain_tokens, mixed_tokens, plain, mixed = _both(model, PROMPTS[:5], _greedy(max_tokens=8), max_num_seqs=3)
    assert mixed_tokens == plain_tokens and mixed.engine.num_steps < plain.engine.num_steps


def test_option(checkpoint):
    from deepinfer.engine.llm_engine import EngineConfig
    from deepinfer.engine.sampling_params import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="mixed_steps must be None"):
        EngineConfig(mixed_steps=1).validate()
    assert _llm(checkpoint, None).engine.scheduler.mixed_steps
    assert not _llm(checkpoint, None, deterministic=True).engine.scheduler.mixed_steps  # auto: off
    with pytest.raises(InvalidRequestError, match="mixed steps do not combine with deterministic mode"):
        _llm(checkpoint, True, deterministic=True)
