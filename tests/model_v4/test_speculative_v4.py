"""Speculative decoding on DeepSeek-V4 (the embedded tiny-v4 with its sliding-window MTP block, reference
backend, float32): greedy tokens with speculation are the tokens without it, with the MTP block's drafts
and with controlled drafts that are always kept or always rejected. A rejected draft's compressor rows
must not overwrite ring rows a later step reads: the rings are `num_drafts` rows longer, rounded up to whole windows.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
FLAT_COSTS = {"1": 0.01, "4096": 0.01, "draft": 0.0}  # given: no start-up probe (minutes of reference forwards)


def prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    return [{"prompt_token_ids": torch.randint(2, 129280, (n,), generator=gen).tolist()} for n in (150, 9, 40)]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    from deepinfer import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(tmp_path_factory.mktemp("cache")))
        llm = LLM(model="tiny-v4", backend="reference", dtype="float32", announce=False)
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def speculative(llm, spec: dict, draft_source=None):
    """Another LLM over llm's loaded model, with its engine config and speculating."""
    import dataclasses

    from deepinfer.engine.llm import LLM
    from deepinfer.engine.llm_engine import LLMEngine

    engine = llm.engine
    config = dataclasses.replace(engine.config, speculative=spec)
    config.validate()
    return LLM.from_engine(LLMEngine(engine.loaded, engine.runtime, engine.dtype, config, draft_source=draft_source))


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("policy", ["fixed", "confidence"])
def test_mtp_drafts_keep_greedy_tokens(plain, policy):
    llm, want = plain
    spec = {"method": "mtp", "num_drafts": 3, "policy": policy, **({"cost_model": FLAT_COSTS} if policy == "confidence" else {})}
    spec_llm = speculative(llm, spec)
    assert tokens(spec_llm) == want
    assert spec_llm.speculative_metrics()["verifications"] > 0
    (layer,) = llm.engine.loaded.model.build_mtp_layers()
    assert layer.layer == llm.engine.loaded.model.num_layers  # the block after the last decoder layer


@pytest.mark.parametrize("agree", [0.0, 1.0])
def test_kept_and_rejected_drafts_keep_greedy_tokens(plain, agree):
    """All drafts kept: several tokens per step; all rejected: every verification writes 3 positions
    of compressor rows that are then overwritten (without the longer rings this changed the 150-token
    prompt's 4th token)."""
    from deepinfer.engine.speculative.controlled_draft import ControlledDraft

    llm, want = plain
    draft = ControlledDraft({tuple(p["prompt_token_ids"]): w for p, w in zip(prompts(), want)}, [agree] * 3, 129280)
    spec_llm = speculative(llm, {"method": "mtp", "num_drafts": 3, "policy": "fixed"}, draft)
    assert tokens(spec_llm) == want
    assert spec_llm.speculative_metrics()["accepted_per_verified"] == agree
    rings = [c.compressor.ring - c.compressor.ratio * (2 if c.compressor.overlap else 1) for c in spec_llm.engine.runner.kv_caches if c.compressor]
    assert rings and set(rings) == {4, 128}  # 3 rows of lookahead, rounded up to whole windows (ratios 4 and 128)


def test_the_budget_counts_the_mtp_block_and_the_longer_rings(plain):
    from deepinfer.engine.model_runner import kv_block_bytes

    model = plain[0].engine.loaded.model
    swa_row = model.config.head_dim * 4  # float32
    assert kv_block_bytes(model, 16, torch.float32, 1) - kv_block_bytes(model, 16, torch.float32) == 16 * swa_row  # a sliding-window block
    rings = sum(c.compressor is not None for c in plain[0].engine.runner.kv_caches)
    assert model.state_slot_bytes(0, 3) > model.state_slot_bytes() and rings
