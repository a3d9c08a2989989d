"""Speculative decoding with vLLM's sampling options, logprobs and n > 1, on the embedded tiny-v3 and
tiny-v4 (their tokenizers, their MTP layers; reference backend, float32).

Greedy tokens with penalties, logit_bias, min_tokens with EOS, bad_words and allowed_token_ids are
the tokens of the run without speculation: each verified row is processed as the step after the
drafts before it would be. The drafts come from ControlledDrafts that follow the expected output
always (every row after the first follows drafts) or at a decaying rate (runs of accepted drafts,
then rejections), and one that follows the output without the option (its drafts are the tokens
the option bans or pushes away, where the option bites). Logprobs and prompt logprobs equal those without speculation. n=2 samples speculate each on
its own: distinct at temperature 1, repeated under the request seed, the tokens without speculation,
the prompt's KV blocks shared, no draft state left behind.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.engine.token_constraints import bad_word_token_ids

NUM_DRAFTS = 3
# seen tokens favoured: random weights hardly repeat a token otherwise, and with these the outputs do
PENALTIES = dict(repetition_penalty=0.4, frequency_penalty=0.5, presence_penalty=0.1)


def _prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(2, 129280, (n,), generator=gen).tolist()} for n in (9, 30)]


PROMPTS = _prompts()
LONG_PROMPT = {"prompt_token_ids": [(7 * i) % 1000 + 2 for i in range(40)]}  # 2 full blocks of 16 + 8 tokens


@pytest.fixture(scope="module", params=["tiny-v3", "tiny-v4"])
def plain(request, tmp_path_factory):
    """An LLM without speculation over the embedded model, and its greedy outputs of PROMPTS."""
    from deepinfer import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(tmp_path_factory.mktemp("cache")))
        llm = LLM(model=request.param, backend="reference", dtype="float32", announce=False, num_kv_blocks=64)
    return llm, _tokens(llm.generate(PROMPTS, _greedy(), use_tqdm=False))


def _speculative(llm, draft_source=None, **config):
    """Another LLM over llm's loaded model, speculating NUM_DRAFTS drafts (the MTP layer's, or draft_source's)."""
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.llm_engine import LLMEngine

    engine = llm.engine
    config = dataclasses.replace(engine.config, speculative={"method": "mtp", "num_drafts": NUM_DRAFTS}, **config)
    config.validate()
    return LLM.from_engine(LLMEngine(engine.loaded, engine.runtime, engine.dtype, config, draft_source=draft_source))


def _controlled(llm, continuations: list[list[int]], first: float = 0.9, decay: float = 0.6, prompts: list[dict] = PROMPTS):
    """Drafts that follow `continuations` (one per prompt) at the rates first, first * decay, ..."""
    from deepinfer.engine.speculative.controlled_draft import ControlledDraft, geometric_profile

    keys = [tuple(p["prompt_token_ids"]) for p in prompts]
    return ControlledDraft(dict(zip(keys, continuations)), geometric_profile(first, decay, NUM_DRAFTS), llm.engine.vocab_size)


def _greedy(**options) -> SamplingParams:
    options.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_tokens=options.pop("max_tokens", 12), **options)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _bad_words(llm, outputs: list[list[int]]) -> list[str]:
    """Words the greedy outputs hold (from their third token on, tokenizing back to those tokens):
    one of two tokens in the first, one of three in the second (banned only right after the tokens
    before their last), and one token."""
    tokenizer = llm.tokenizer
    words = [tokenizer.decode(outputs[0][5:6])]
    for out, size in zip(outputs, (2, 3)):
        for i in range(2, len(out) - size + 1):
            word = tokenizer.decode(out[i : i + size])
            if bad_word_token_ids(tokenizer, [word])[0] == out[i : i + size]:
                words.append(word)
                break
        else:
            raise AssertionError(f"no word of {size} tokens in {out}")
    return words


def _options(llm, outputs: list[list[int]], eos: int) -> dict[str, dict]:
    """Each option case's SamplingParams options, chosen so that they change the greedy outputs."""
    first, second = outputs
    return {
        "penalties": dict(PENALTIES),
        "logit-bias": dict(logit_bias={first[3]: -100.0, second[2]: -3.0, first[0]: 4.0}),
        "min-tokens-eos": dict(min_tokens=5, ignore_eos=False, logit_bias={eos: 30.0}),
        "bad-words": dict(bad_words=_bad_words(llm, outputs)),
        "allowed": dict(allowed_token_ids=sorted(set(first[::2] + second[1::3] + list(range(2, 40))))),
        "everything": dict(PENALTIES, logit_bias={second[4]: 2.0}, bad_words=_bad_words(llm, outputs), min_tokens=3, ignore_eos=False),
    }


@pytest.mark.parametrize("case", ["penalties", "logit-bias", "min-tokens-eos", "bad-words", "allowed", "everything"])
def test_greedy_options_give_the_tokens_without_speculation(plain, case):
    llm, unconstrained = plain
    eos = min(llm.engine.eos_token_ids)
    params = _greedy(**_options(llm, unconstrained, eos)[case])
    want = _tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    assert want != unconstrained, "the option must change the output, or the test proves nothing"
    if case == "min-tokens-eos":
        assert [len(w) for w in want] == [6, 6] and all(w[-1] == eos for w in want)  # EOS right after the 5 it was banned for
    right = _speculative(llm, _controlled(llm, want, first=1.0, decay=1.0))  # every draft kept: rows 1..k follow drafts
    assert _tokens(right.generate(PROMPTS, params, use_tqdm=False)) == want
    mixed = _speculative(llm, _controlled(llm, want))
    assert _tokens(mixed.generate(PROMPTS, params, use_tqdm=False)) == want
    metrics = mixed.speculative_metrics()
    assert 0 < metrics["accepted_per_verified"] < 1, metrics  # runs accepted, and drafts rejected
    # drafts that follow the output without the option: the tokens it bans or pushes away, proposed where it bites
    wrong = _speculative(llm, _controlled(llm, unconstrained, first=1.0, decay=1.0))
    assert _tokens(wrong.generate(PROMPTS, params, use_tqdm=False)) == want


def _logprob_rows(rows):
    return [[(token, p.rank, p.logprob) for token, p in row.items()] if row is not None else None for row in rows]


def _assert_same_logprobs(got, want):
    assert len(got) == len(want)
    for g, w in zip(_logprob_rows(got), _logprob_rows(want)):
        assert (g is None) == (w is None)
        if g is not None:
            assert [(t, r) for t, r, _ in g] == [(t, r) for t, r, _ in w]
            assert torch.allclose(torch.tensor([lp for *_, lp in g]), torch.tensor([lp for *_, lp in w]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("drafter", ["mtp", "controlled"])
def test_logprobs_and_prompt_logprobs_equal_those_without_speculation(plain, drafter):
    """Greedy with penalties (processed rows, raw logprobs) and prompt logprobs (the prefill's
    prompt rows beside the sampling rows the MTP pass reads)."""
    llm, _ = plain
    params = _greedy(logprobs=3, prompt_logprobs=2, **PENALTIES)
    want = llm.generate(PROMPTS, params, use_tqdm=False)
    spec = _speculative(llm, _controlled(llm, _tokens(want)) if drafter == "controlled" else None)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    if drafter == "controlled":
        assert 0 < spec.speculative_metrics()["accepted_per_verified"] < 1
    for g, w in zip(got, want):
        _assert_same_logprobs(g.outputs[0].logprobs, w.outputs[0].logprobs)
        _assert_same_logprobs(g.prompt_logprobs, w.prompt_logprobs)
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-4)
        assert len(g.outputs[0].logprobs) == len(g.outputs[0].token_ids) and g.prompt_logprobs[0] is None


def test_prompt_logprobs_leave_the_mtp_draft_as_it_is(plain):
    """With prompt logprobs a prefill's logits rows hold the prompt positions too; the MTP pass still
    reads the sampler's last row: the same draft 1 and hidden state as without them."""
    llm, _ = plain
    engine = _speculative(llm, enable_prefix_caching=False).engine
    states = []
    for options in ({}, dict(prompt_logprobs=1)):
        seq = engine.add_request(PROMPTS[1]["prompt_token_ids"], _greedy(max_tokens=4, **options))
        engine.step()
        assert seq.num_output_tokens == 1
        states.append(engine.speculative.drafter.state[seq.seq_id])
        engine.abort_all()
    (draft, confidence, hidden), (draft_lp, confidence_lp, hidden_lp) = states
    assert draft == draft_lp and confidence == pytest.approx(confidence_lp, abs=1e-5)
    assert torch.allclose(hidden, hidden_lp, atol=1e-5)


@pytest.mark.parametrize("drafter", ["mtp", "controlled"])
def test_parallel_samples_speculate_each_on_its_own(plain, drafter):
    """n=2 at temperature 1 under a request seed, with penalties (a history slot per sample):
    distinct samples, the same on a rerun, and the samples drawn without speculation (the
    verification draws `sample`'s own noise from the processed rows)."""
    llm, _ = plain
    params = SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=8, ignore_eos=True, **PENALTIES)
    prompts = [LONG_PROMPT, PROMPTS[0]]
    want = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    draft = _controlled(llm, [samples[0] for samples in want], prompts=prompts) if drafter == "controlled" else None
    spec = _speculative(llm, draft)
    got = [[c.token_ids for c in o.outputs] for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert all(len({tuple(s) for s in samples}) == 2 for samples in got)
    again = [[c.token_ids for c in o.outputs] for o in spec.generate(prompts, params, use_tqdm=False)]
    assert again == got
    if drafter == "mtp":
        assert spec.engine.speculative.drafter.state == {}  # every sample's draft state was dropped when it finished


def test_parallel_samples_share_the_prompts_blocks_while_speculating(plain):
    llm, _ = plain
    spec = _speculative(llm)
    engine, bm = spec.engine, spec.engine.block_manager
    assert engine.block_size == 16
    head = engine.add_request(LONG_PROMPT["prompt_token_ids"], SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=9, ignore_eos=True,
                                                                                  presence_penalty=0.5))  # fmt: skip
    children = head.samples[1:]
    engine.step()  # sample 0's prompt prefill (and its first token)
    assert head.num_output_tokens == 1 and engine.scheduler.waiting == children
    engine.step()  # the other samples are admitted with the prompt's full blocks as prefix hits
    assert all(c.block_table[:2] == head.block_table[:2] and c.num_cached_tokens == 32 for c in children)
    assert [bm.blocks[b].ref_count for b in head.block_table[:2]] == [3, 3]
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert finished == [head]
    output = engine.make_output(head)
    assert [len(c.token_ids) for c in output.outputs] == [9, 9, 9] and len({tuple(c.token_ids) for c in output.outputs}) == 3
    assert sum(c.num_drafts_verified for c in head.samples) > 0
    assert bm.num_free_blocks == bm.num_blocks and engine.speculative.drafter.state == {}
