"""Speculative decoding end to end on the reference backend (the embedded tiny V3 with a 512-token
vocabulary and its MTP layer, float32).

Greedy outputs with speculation are the outputs without it: with the MTP layer's drafts (random
weights: almost all rejected) and with a ControlledDraft that agrees with the known continuation
at a geometric rate (so runs of several drafts are accepted), for both policies and k = 1..5,
alone and batched, with EOS / stop ids / max_tokens landing inside an accepted run, after
preemption and after prefix hits. Sampled requests keep their tokens too (the verification draws
`sample`'s own noise); a chi-square test compares 20000 samples' distributions.
"""

from __future__ import annotations

import pytest

from engine.determinism import SMALL_VOCAB, neighbour_prompts, write_small_checkpoint

FLAT_COSTS = {"1": 0.01, "4096": 0.01, "draft": 0.0}  # a step costs the same whatever its tokens: verify everything likely


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_small_checkpoint(tmp_path_factory.mktemp("small") / "tiny-v3-mtp", num_hidden_layers=2)


def _llm(checkpoint, speculative=None, draft_source=None, **kwargs):
    from deepinfer import LLM
    from deepinfer.engine.llm_engine import LLMEngine

    llm = LLM(model=str(checkpoint), backend="reference", dtype="float32", announce=False, num_kv_blocks=kwargs.pop("num_kv_blocks", 256), **kwargs)
    if speculative is None:
        return llm
    engine = llm.engine
    config = engine.config
    config.speculative = speculative
    config.validate()
    return LLM.from_engine(LLMEngine(engine.loaded, engine.runtime, engine.dtype, config, draft_source=draft_source))


PROMPTS = neighbour_prompts(6, SMALL_VOCAB, seed=11, lengths=(3, 40))


def _greedy(max_tokens=14, **kwargs):
    from deepinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def baseline(checkpoint):
    llm = _llm(checkpoint)
    return llm, _tokens(llm.generate(PROMPTS, _greedy(), use_tqdm=False))


def _controlled(want, prompts=PROMPTS, first=0.9, decay=0.85):
    from deepinfer.engine.speculative.controlled_draft import ControlledDraft, geometric_profile

    continuations = {tuple(p["prompt_token_ids"]): w for p, w in zip(prompts, want)}
    return ControlledDraft(continuations, geometric_profile(first, decay, 8), SMALL_VOCAB, spread=0.3)


@pytest.mark.parametrize("policy", ["fixed", "confidence"])
def test_mtp_drafts_keep_greedy_outputs(checkpoint, baseline, policy):
    spec = {"method": "mtp", "num_drafts": 3, "policy": policy, **({"cost_model": FLAT_COSTS} if policy == "confidence" else {})}
    llm = _llm(checkpoint, spec)
    assert _tokens(llm.generate(PROMPTS, _greedy(), use_tqdm=False)) == baseline[1]
    alone = _tokens(llm.generate(PROMPTS[2], _greedy(), use_tqdm=False))
    assert alone == [baseline[1][2]]
    metrics = llm.speculative_metrics()
    assert metrics["verifications"] > 0 and metrics["drafts_verified_per_step"] > 0


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("policy", ["fixed", "confidence"])
def test_accepted_runs_keep_greedy_outputs(checkpoint, baseline, k, policy):
    spec = {"method": "mtp", "num_drafts": k, "policy": policy, **({"cost_model": FLAT_COSTS} if policy == "confidence" else {})}
    llm = _llm(checkpoint, spec, draft_source=_controlled(baseline[1]))
    outputs = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    assert _tokens(outputs) == baseline[1]
    metrics = llm.speculative_metrics()
    if k > 1:
        assert metrics["acceptance_length"] > 1.5, metrics  # runs of drafts were accepted
    assert sum(o.metrics["num_drafts_accepted"] for o in outputs) > 0


def test_stops_inside_an_accepted_run(checkpoint, baseline):
    """A stop token id, EOS and max_tokens each land inside a run of accepted drafts: the tokens
    after them are dropped, and the outputs are those without speculation."""
    from deepinfer import SamplingParams

    llm_plain = baseline[0]
    want = baseline[1]
    stop_ids = [w[6] for w in want]  # the 7th token of each output: inside a run at k = 5
    params = [_greedy(stop_token_ids=[s]) for s in stop_ids]
    expected = _tokens(llm_plain.generate(PROMPTS, params, use_tqdm=False))
    assert all(len(e) <= 7 for e in expected)
    llm = _llm(checkpoint, {"method": "mtp", "num_drafts": 5}, draft_source=_controlled(want, first=1.0, decay=1.0))
    assert _tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == expected
    # EOS: the model's eos id (1) placed as a continuation token makes the draft propose it
    eos = [SamplingParams(temperature=0.0, max_tokens=14) for _ in PROMPTS]
    assert _tokens(llm.generate(PROMPTS, eos, use_tqdm=False)) == _tokens(llm_plain.generate(PROMPTS, eos, use_tqdm=False))
    short = [_greedy(max_tokens=n) for n in (2, 3, 4, 5, 7, 9)]
    outputs = llm.generate(PROMPTS, short, use_tqdm=False)
    assert _tokens(outputs) == [w[:n] for w, n in zip(want, (2, 3, 4, 5, 7, 9))]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_preemption_and_prefix_hits(checkpoint, baseline):
    """Few KV pages: the lookahead's pages preempt requests, which are recomputed; a second run of
    the same prompts hits the prefix cache. Outputs stay those without speculation."""
    prompts = PROMPTS + neighbour_prompts(6, SMALL_VOCAB, seed=12, lengths=(20, 40))
    want = _tokens(baseline[0].generate(prompts, _greedy(), use_tqdm=False))
    llm = _llm(checkpoint, {"method": "mtp", "num_drafts": 4}, draft_source=_controlled(want, prompts), num_kv_blocks=12)
    outputs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert _tokens(outputs) == want
    assert llm.engine.scheduler.num_preemptions > 0
    again = llm.generate(prompts[-2:], _greedy(), use_tqdm=False)  # the last ones' pages are still cached
    assert _tokens(again) == want[-2:]
    assert all(o.num_cached_tokens > 0 for o in again)


def test_chunked_prefill_and_mtp_cache_rows(checkpoint):
    """The MTP layer's cache rows of a decoded request equal those a prefill of the same tokens
    writes (chained drafts' rows were rewritten with the target's hidden states), to float32
    rounding; the prefill itself in chunks of 5 tokens."""
    import torch

    from deepinfer import SamplingParams

    spec = {"method": "mtp", "num_drafts": 3}
    llm = _llm(checkpoint, spec, max_num_batched_tokens=5, enable_prefix_caching=False)
    engine = llm.engine
    seq = engine.add_request(PROMPTS[1]["prompt_token_ids"], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    while seq.num_output_tokens < 12:
        engine.step()
    computed, table, tokens = seq.num_computed_tokens, list(seq.block_table), list(seq.token_ids)
    cache = engine.runner.draft_kv_caches[0]
    bs = engine.block_size

    def rows(block_table, n):
        return torch.stack([cache[block_table[p // bs], p % bs] for p in range(n)])

    decoded = rows(table, computed).clone()
    engine.abort_all()
    fresh = engine.add_request(tokens[: computed + 1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while fresh.num_output_tokens < 1:
        engine.step()
    prefilled = rows(fresh.block_table, computed)
    assert torch.allclose(decoded, prefilled, atol=1e-4, rtol=1e-4), float((decoded - prefilled).abs().max())


def test_sampled_tokens_match_those_without_speculation(checkpoint):
    """Temperature 1 (top-p 0.9 on half the requests), 4000 requests with seeds: the tokens with
    speculation are the tokens without it, request by request (the verification draws `sample`'s
    noise), so their distributions are the same too; drafts are verified for every request."""
    from deepinfer import SamplingParams

    # one dense layer and a dense MTP layer (first_k_dense_replace past both): the cheapest model with every path
    vocab_ckpt = write_small_checkpoint(checkpoint.parent / "tiny-v3-vocab64", num_hidden_layers=1, first_k_dense_replace=2, vocab_size=64)
    prompt = {"prompt_token_ids": [5, 9, 14, 3]}
    n = 4000
    params = [SamplingParams(temperature=1.0, top_p=0.9 if i % 2 else 1.0, max_tokens=3, ignore_eos=True, seed=i) for i in range(n)]
    plain = _llm(vocab_ckpt, max_num_seqs=2048, num_kv_blocks=2048)
    want = _tokens(plain.generate([prompt] * n, params, use_tqdm=False))
    spec = _llm(vocab_ckpt, {"method": "mtp", "num_drafts": 2}, max_num_seqs=2048, num_kv_blocks=2048)
    got = _tokens(spec.generate([prompt] * n, params, use_tqdm=False))
    assert spec.speculative_metrics()["verifications"] >= n
    assert len({w[2] for w in want}) > 20, "the third tokens spread over the vocabulary: the seeds draw different tokens"
    assert got == want


def test_deterministic_mode_with_speculation(checkpoint, baseline):
    llm = _llm(checkpoint, {"method": "mtp", "num_drafts": 2}, deterministic=True)
    plain = _llm(checkpoint, deterministic=True)
    assert _tokens(llm.generate(PROMPTS[:3], _greedy(8), use_tqdm=False)) == _tokens(plain.generate(PROMPTS[:3], _greedy(8), use_tqdm=False))


@pytest.mark.parametrize(
    "value, message",
    [
        ("eagle", "method must be one of mtp"),
        ("mtp:0", "num_drafts must be an integer in [1, 16]"),
        ("mtp:3:sometimes", "policy must be one of fixed, confidence"),
        ({"method": "mtp", "drafts": 3}, "unknown key 'drafts'"),
        ("{bad json", "is not valid JSON"),
        ({"method": "mtp", "policy": "fixed", "cost_model": {"1": 0.1}}, "cost_model is for policies 'confidence' and 'head' only"),
        ({"method": "mtp", "policy": "confidence", "cost_model": {"0": 0.1}}, "token count >= 1"),
    ],
)
def test_bad_speculative_config_is_one_line(value, message):
    from deepinfer.engine.sampling_params import InvalidRequestError
    from deepinfer.engine.speculative.config import SpeculativeConfig

    with pytest.raises(InvalidRequestError) as info:
        SpeculativeConfig.parse(value)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_checkpoint_without_mtp_layers_is_refused(tmp_path):
    from deepinfer import LLM
    from deepinfer.model.errors import LoadError

    folder = write_small_checkpoint(tmp_path / "no-mtp", num_hidden_layers=1, num_nextn_predict_layers=0)
    with pytest.raises(LoadError, match="this checkpoint has no MTP layers"):
        LLM(model=str(folder), backend="reference", dtype="float32", announce=False, num_kv_blocks=8, speculative="mtp:2")
