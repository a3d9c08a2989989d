"""Structured output with speculative decoding on the embedded tiny-v3 (its tokenizer and MTP layer;
reference backend, float32): each verification row is masked by the grammar after the drafts
before it (the matcher advanced through the drafts and rolled back), so a draft the grammar refuses
is rejected and the request's matcher only ever holds the tokens kept.

Greedy and seeded outputs equal those without speculation, whether the drafts come from the MTP
layer (random weights: nearly all rejected) or follow the known output at a decaying rate (runs of
accepted drafts, then a rejection and a rollback); every output validates.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from deepinfer import SamplingParams

NUM_DRAFTS = 3
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{2,6}$"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3}},
          "required": ["name", "n", "tags"], "additionalProperties": False}  # fmt: skip
DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
STRUCTURED = [
    {"json": SCHEMA, "disable_any_whitespace": True},
    {"regex": DATE},
    {"choice": ["New York", "New Jersey", "Newark"]},
    None,  # a free request in the same batch
]
PROMPTS = [{"prompt_token_ids": [5 + 11 * i + j for j in range(6 + i)]} for i in range(len(STRUCTURED))]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    from deepinfer import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(tmp_path_factory.mktemp("cache")))
        return LLM(model="tiny-v3", backend="reference", dtype="float32", announce=False, num_kv_blocks=64)


def _speculative(llm, draft_source=None):
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.llm_engine import LLMEngine

    engine = llm.engine
    config = dataclasses.replace(engine.config, speculative={"method": "mtp", "num_drafts": NUM_DRAFTS})
    config.validate()
    return LLM.from_engine(LLMEngine(engine.loaded, engine.runtime, engine.dtype, config, draft_source=draft_source))


def _params(temperature: float) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, seed=40 + i, max_tokens=40 if s else 12, structured_outputs=s) for i, s in enumerate(STRUCTURED)]


def _check(outputs) -> None:
    schema, date, choice, free = (o.outputs[0] for o in outputs)
    assert schema.finish_reason == "stop", schema.text
    jsonschema.validate(json.loads(schema.text), SCHEMA)
    assert date.finish_reason == "stop" and re.fullmatch(DATE, date.text), date.text
    assert choice.finish_reason == "stop" and choice.text in STRUCTURED[2]["choice"], choice.text
    assert free.finish_reason == "length" and len(free.token_ids) == 12


@pytest.mark.parametrize(
    "drafter, temperature", [("mtp", 0.0), ("controlled", 0.0), ("controlled", 1.0)], ids=["mtp-greedy", "controlled-greedy", "controlled-seeded"]
)  # the MTP layer's drafts seeded too would cost CI 20 s more on the CPU
def test_outputs_equal_those_without_speculation(plain, drafter, temperature):
    from deepinfer.engine.speculative.controlled_draft import ControlledDraft, geometric_profile

    params = _params(temperature)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    _check(want)
    tokens = [o.outputs[0].token_ids for o in want]
    draft = None
    if drafter == "controlled":  # drafts follow the known output at 0.9, 0.54, 0.32: accepted runs, then a rejection
        keys = [tuple(p["prompt_token_ids"]) for p in PROMPTS]
        draft = ControlledDraft(dict(zip(keys, tokens)), geometric_profile(0.9, 0.6, NUM_DRAFTS), plain.engine.vocab_size)
    spec = _speculative(plain, draft)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == tokens
    _check(got)
    verified = [o.metrics["num_drafts_verified"] for o in got[:3]]
    accepted = [o.metrics["num_drafts_accepted"] for o in got[:3]]
    assert sum(verified) > 0
    if drafter == "controlled":  # drafts kept through the grammar, and drafts rolled back
        assert all(a > 0 for a in accepted) and sum(verified) > sum(accepted), (verified, accepted)
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params, use_tqdm=False)] == tokens  # the same again


def test_grammar_refused_drafts_are_rejected(plain):
    """Drafts that never agree (a token other than the known one: almost always one the grammar
    refuses): none is accepted where the grammar refuses it, and the output is the one without them."""
    from deepinfer.engine.speculative.controlled_draft import ControlledDraft

    params = _params(0.0)[:3]
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:3], params, use_tqdm=False)]
    keys = [tuple(p["prompt_token_ids"]) for p in PROMPTS[:3]]
    draft = ControlledDraft(dict(zip(keys, want)), [0.0] * NUM_DRAFTS, plain.engine.vocab_size)
    spec = _speculative(plain, draft)
    got = spec.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert all(o.metrics["num_drafts_verified"] > 0 and o.metrics["num_drafts_accepted"] == 0 for o in got)
