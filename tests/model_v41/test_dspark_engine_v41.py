"""DSpark speculative decoding on DeepSeek-V4.1 through the engine (reference backend, float32).

Greedy tokens with `speculative="dspark"` are the tokens without it, on the tiny oracle checkpoint (three draft
blocks, window 16) and on the embedded tiny-v41 (one block), with the bounded replay on and off, for the fixed
and the head policies. Random weights accept few DSpark drafts, so a ControlledDraft (drafts that agree with the
known continuation at a geometric rate) drives runs of accepted and rejected drafts through the V4.1 state: the
window rings, the ratio-2 compressor's pending tokens and Engram's n-gram history, whose rows a rejected draft
overwrote (caches.py keeps slack for them). Sampled requests keep their tokens (the verification draws
`sample`'s own noise). Other models refuse dspark, and V4.1 refuses mtp, in one line.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from deepinfer import LLM, SamplingParams
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.sampling_params import InvalidRequestError

from model_v41.make_oracle_fixtures import FIXTURE, PROMPTS
from model_v41.tiny_v41 import write_oracle_checkpoint

FLAT_COSTS = {"1": 0.01, "4096": 0.01, "draft": 0.0}  # wider steps cost nothing: the head policy verifies every draft
STEEP_COSTS = {"1": 0.01, "2": 1.0, "draft": 0.0}  # any draft costs a hundred steps: it verifies none
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_oracle_checkpoint(tmp_path_factory.mktemp("v41") / "oracle")


@pytest.fixture(scope="module")
def prompts():
    fixture = load_file(str(FIXTURE))
    return [{"prompt_token_ids": fixture[f"p{p}.ids"].tolist()[:40]} for p in range(PROMPTS)] + [{"prompt_token_ids": [7, 30, 41, 9, 99, 12, 5]}]


def _llm(model, **engine):
    return LLM(model=str(model), backend="reference", dtype="float32", max_model_len=256, announce=False, **engine)


def _tokens(llm, prompts, params=None):
    params = params or SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def baselines(folder, prompts):
    return {replay: _tokens(_llm(folder, swa_bounded_replay=replay), prompts) for replay in (True, False)}


SPECS = ["dspark:5:fixed", {"method": "dspark", "cost_model": FLAT_COSTS}, {"method": "dspark", "num_drafts": 3, "cost_model": STEEP_COSTS}]


@pytest.mark.parametrize("replay", [True, False], ids=["bounded_replay", "every_layer"])
@pytest.mark.parametrize("spec", SPECS, ids=["fixed", "head_flat_costs", "head_steep_costs"])
def test_dspark_keeps_greedy_tokens(folder, prompts, baselines, replay, spec):
    llm = _llm(folder, swa_bounded_replay=replay, speculative=spec)
    assert _tokens(llm, prompts) == baselines[replay]
    metrics = llm.speculative_metrics()
    assert metrics["verifications"] > 0
    if isinstance(spec, dict) and spec["cost_model"] is STEEP_COSTS:
        assert metrics["drafts_verified_per_step"] == 0
    else:
        assert metrics["drafts_verified_per_step"] > 1


def test_dspark_defaults_to_the_block_and_the_head_policy(folder):
    engine = _llm(folder, speculative={"method": "dspark", "cost_model": FLAT_COSTS}).engine
    assert (engine.config.speculative.num_drafts, engine.config.speculative.policy) == (5, "head")
    with pytest.raises(InvalidRequestError, match="at most the checkpoint's block of 5 tokens"):
        _llm(folder, speculative="dspark:6:fixed")


@pytest.mark.parametrize("replay", [True, False], ids=["bounded_replay", "every_layer"])
def test_accepted_and_rejected_runs_through_the_v41_state_keep_greedy_tokens(folder, prompts, baselines, replay):
    from deepinfer.engine.speculative.controlled_draft import ControlledDraft, geometric_profile

    want = baselines[replay]
    continuations = {tuple(p["prompt_token_ids"]): w for p, w in zip(prompts, want)}
    draft = ControlledDraft(continuations, geometric_profile(0.9, 0.85, 5), 256, spread=0.3)
    base = _llm(folder, swa_bounded_replay=replay).engine
    config = base.config
    config.speculative = "dspark:5:fixed"
    config.validate()
    llm = LLM.from_engine(LLMEngine(base.loaded, base.runtime, base.dtype, config, draft_source=draft))
    assert _tokens(llm, prompts) == want
    metrics = llm.speculative_metrics()
    assert metrics["acceptance_length"] > 2 and metrics["accepted_per_verified"] < 0.9  # long runs, and rejections inside blocks


def test_sampled_tokens_match_those_without_speculation(folder, prompts):
    params = [SamplingParams(temperature=1.0, top_p=0.9 if i % 2 else 1.0, max_tokens=10, ignore_eos=True, seed=i) for i in range(len(prompts))]
    want = _tokens(_llm(folder), prompts, params)
    assert _tokens(_llm(folder, speculative="dspark:5:fixed"), prompts, params) == want


def test_the_embedded_tiny_v41_drafts_with_its_one_block():
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 30)]
    want = _tokens(LLM(model="tiny-v41", backend="reference", dtype="float32", announce=False), prompts)
    llm = LLM(model="tiny-v41", backend="reference", dtype="float32", announce=False, speculative="dspark:5:fixed")
    assert _tokens(llm, prompts) == want
    metrics = llm.speculative_metrics()
    assert metrics["verifications"] > 0 and metrics["drafts_verified_per_step"] > 4  # fixed: the whole block, fewer near max_tokens


def test_other_models_refuse_dspark_and_v41_refuses_mtp_in_one_line(folder):
    with pytest.raises(InvalidRequestError) as info:
        LLM(model="tiny-v3", backend="reference", dtype="float32", announce=False, num_kv_blocks=8, speculative="dspark")
    assert "DSpark" in str(info.value) and "mtp:K:fixed|confidence" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        _llm(folder, speculative="mtp:3")
    assert "--speculative dspark" in str(info.value) and "\n" not in str(info.value)
