"""vLLM's sampling options end to end on the toy engine (reference backend), against oracles that
recompute every token from the cacheless logits with the options' definitions written out here in
float64: penalties, logit_bias, allowed_token_ids, bad_words, min_tokens (with EOS, stop token ids
and stop strings), include_stop_str_in_output, logprobs and prompt_logprobs. Then the ways a run
can differ from one request decoding alone: batching with other requests, chunked prefill,
preemption, overlap scheduling; and the one-line errors."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.engine.sampling_params import InvalidRequestError
from deepinfer.engine.token_constraints import bad_word_token_ids

from engine.toy_engine import ToyTokenizer, toy_llm

PROMPT = "Hello there"
PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.7)


def processed_logits(x: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int], tokenizer) -> torch.Tensor:
    """The options' definitions on one position's logits x (any float dtype), in vLLM's order:
    allowed_token_ids, bad_words, min_tokens, logit_bias, then the penalties."""
    x = x.clone()
    neg_inf = float("-inf")
    if params.allowed_token_ids is not None:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[params.allowed_token_ids] = True
        x[~keep] = neg_inf
    for word in bad_word_token_ids(tokenizer, params.bad_words):
        if len(word) == 1 or output[-(len(word) - 1) :] == word[:-1]:
            x[word[-1]] = neg_inf
    if len(output) < params.min_tokens:
        for t in set(params.stop_token_ids) | ({ToyTokenizer.eos_token_id} if not params.ignore_eos else set()):
            x[t] = neg_inf
    for t, bias in params.logit_bias.items():
        x[t] += bias
    for v in range(x.shape[0]):
        count = output.count(v)
        if count or v in prompt:
            x[v] = x[v] / params.repetition_penalty if x[v] > 0 else x[v] * params.repetition_penalty
        x[v] -= params.frequency_penalty * count
        if count:
            x[v] -= params.presence_penalty
    return x


def oracle_greedy(llm, prompt: str, params: SamplingParams, steps: int) -> list[int]:
    """Greedy tokens by the definitions in float64, each from a fresh cacheless forward."""
    model, tokenizer = llm.engine.loaded.model, llm.tokenizer
    ids = tokenizer.encode(prompt)
    out = []
    for _ in range(steps):
        x = processed_logits(model.reference_logits(ids + out).double(), params, ids, out, tokenizer)
        out.append(int(x.argmax()))
        if not params.ignore_eos and out[-1] == ToyTokenizer.eos_token_id and len(out) > params.min_tokens:
            break
    return out


def generate(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def greedy(**options) -> SamplingParams:
    options.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0, max_tokens=options.pop("max_tokens", 12), **options)


@pytest.mark.parametrize(
    "options",
    [
        dict(PENALTIES),
        dict(repetition_penalty=0.5),  # < 1: seen tokens favoured
        dict(frequency_penalty=-0.3, presence_penalty=2.0),
        dict(logit_bias={20: 2.5, 2: -1.0, 35: 0.75}),
        dict(allowed_token_ids=[5, 9, 14, 20, 33, 41, 60]),
        dict(bad_words=["km", "q", "mmq"]),  # "Hello there" greedily continues "kkkmmqkkkkkmkkkk"
        dict(PENALTIES, logit_bias={30: 1.5}, allowed_token_ids=list(range(2, 50)), bad_words=["ab"]),
    ],
    ids=["penalties", "repetition-below-1", "negative-frequency", "logit-bias", "allowed", "bad-words", "everything"],
)
def test_greedy_options_follow_their_definitions(options):
    llm = toy_llm()
    plain = generate(llm, [PROMPT], greedy())[0].token_ids
    want = oracle_greedy(llm, PROMPT, greedy(**options), 12)
    assert want != plain, "the oracle must see the option change the output, or the test proves nothing"
    assert generate(llm, [PROMPT], greedy(**options))[0].token_ids == want


def test_bad_words_never_appear_in_the_text():
    llm = toy_llm()
    plain = generate(llm, [PROMPT], greedy(max_tokens=16))[0]
    word = plain.text[2:4]  # two characters the plain output holds
    out = generate(llm, [PROMPT], greedy(max_tokens=16, bad_words=[word]))[0]
    assert word in plain.text and word not in out.text


def test_allowed_token_ids_and_bias_hold_for_sampled_tokens():
    llm = toy_llm()
    allowed = [7, 8, 30, 44]
    out = generate(llm, [PROMPT], SamplingParams(temperature=2.0, max_tokens=20, seed=3, ignore_eos=True, allowed_token_ids=allowed))[0]
    assert set(out.token_ids) <= set(allowed) and len(set(out.token_ids)) > 1
    out = generate(llm, [PROMPT], SamplingParams(temperature=1.0, max_tokens=10, seed=3, ignore_eos=True, logit_bias={40: 100.0}))[0]
    assert out.token_ids == [40] * 10


def test_sampled_tokens_with_penalties_follow_the_sample_op_on_processed_logits():
    """Sampled (temperature, top-k, top-p): each token is `sample` (same seed and position) over the
    logits processed by the definitions, here in float32 as the engine processes them."""
    from engine.toy_engine import reference_runtime

    llm = toy_llm()
    params = SamplingParams(temperature=1.3, top_k=30, top_p=0.9, max_tokens=10, seed=77, ignore_eos=True, **PENALTIES)
    got = generate(llm, [PROMPT], params)[0].token_ids
    ops, model = reference_runtime(4).ops, llm.engine.loaded.model
    ids, want = llm.tokenizer.encode(PROMPT), []
    for _ in range(10):
        x = processed_logits(model.reference_logits(ids + want), params, ids, want, llm.tokenizer)
        one = lambda v, dtype=torch.float32: torch.tensor([v], dtype=dtype)  # noqa: E731
        want.append(int(ops.sample(x[None], one(1.3), one(30, torch.int32), one(0.9), one(0.0), one(77, torch.int64), one(len(ids) + len(want), torch.int64))))
    assert got == want
    assert got != generate(llm, [PROMPT], SamplingParams(temperature=1.3, top_k=30, top_p=0.9, max_tokens=10, seed=77, ignore_eos=True))[0].token_ids


def test_min_tokens_holds_back_eos_and_stop_token_ids():
    llm = toy_llm()
    eos = ToyTokenizer.eos_token_id
    forced_eos = dict(temperature=0, max_tokens=10, logit_bias={eos: 100.0})
    out = generate(llm, [PROMPT], SamplingParams(**forced_eos))[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    out = generate(llm, [PROMPT], SamplingParams(**forced_eos, min_tokens=3))[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos and eos not in out.token_ids[:3] and out.finish_reason == "stop"
    assert out.token_ids == oracle_greedy(llm, PROMPT, SamplingParams(**forced_eos, min_tokens=3), 10)
    # A stop token id: held back the same way.
    out = generate(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=10, logit_bias={25: 100.0}, stop_token_ids=[25], min_tokens=2))[0]
    assert len(out.token_ids) == 3 and out.token_ids[-1] == 25 and 25 not in out.token_ids[:2] and out.stop_reason == 25
    # min_tokens == max_tokens: never stopped early, ends by length.
    out = generate(llm, [PROMPT], SamplingParams(**{**forced_eos, "max_tokens": 5}, min_tokens=5))[0]
    assert len(out.token_ids) == 5 and eos not in out.token_ids and out.finish_reason == "length"


def test_min_tokens_delays_stop_strings():
    llm = toy_llm()
    plain = generate(llm, [PROMPT], greedy(max_tokens=16))[0]
    stop = plain.text[0]
    later = plain.text.find(stop, 3)
    assert later > 3, f"the test needs the first character again after the third: {plain.text!r}"
    out = generate(llm, [PROMPT], greedy(max_tokens=16, stop=[stop]))[0]
    assert out.text == "" and len(out.token_ids) == 1
    out = generate(llm, [PROMPT], greedy(max_tokens=16, stop=[stop], min_tokens=3))[0]
    # Not found in the first three tokens' text, nor in text ending inside it: the next occurrence stops it.
    assert out.stop_reason == stop and out.text == plain.text[:later] and out.token_ids == plain.token_ids[: later + 1]


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_token():
    llm = toy_llm()
    plain = generate(llm, [PROMPT], greedy(max_tokens=16))[0]
    stop = plain.text[4:6]
    first = plain.text.find(stop)
    out = generate(llm, [PROMPT], greedy(max_tokens=16, stop=[stop], include_stop_str_in_output=True))[0]
    assert out.stop_reason == stop and out.text == plain.text[: first + len(stop)]
    assert generate(llm, [PROMPT], greedy(max_tokens=16, stop=[stop]))[0].text == plain.text[:first]
    eos = ToyTokenizer.eos_token_id
    kept = dict(temperature=0, max_tokens=4, logit_bias={eos: 100.0}, min_tokens=2, skip_special_tokens=False)
    out = generate(llm, [PROMPT], SamplingParams(**kept, include_stop_str_in_output=True))[0]
    assert out.finish_reason == "stop" and out.text.endswith("<eos>")
    assert not generate(llm, [PROMPT], SamplingParams(**kept))[0].text.endswith("<eos>")


def float64_logprobs(llm, ids: list[int]) -> torch.Tensor:
    return llm.engine.loaded.model.reference_logits(ids).double().log_softmax(-1)


def check_position(position, chosen: int, lp: torch.Tensor, k: int, logits: torch.Tensor):
    """One position's {token: Logprob} against float64 log-probabilities and the logits' order."""
    ids = list(position)
    assert ids[0] == chosen and position[chosen].rank == int((logits >= logits[chosen]).sum())
    order = torch.sort(logits, descending=True, stable=True).indices[:k].tolist()
    assert ids == [chosen] + [t for t in order if t != chosen], "the chosen token first, then the top ones (vLLM's layout)"
    assert {t: position[t].rank for t in order} == {t: i + 1 for i, t in enumerate(order)}
    for t, entry in position.items():
        assert abs(entry.logprob - float(lp[t])) < 1e-5
        assert entry.decoded_token == ToyTokenizer().decode([t], skip_special_tokens=False)


def test_logprobs_are_the_raw_model_distribution():
    """logprobs: per generated token its log_softmax under the model (before temperature and
    penalties), its rank and the top k; cumulative_logprob their sum."""
    llm = toy_llm()
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True, logprobs=3, **PENALTIES)
    out = generate(llm, [PROMPT], params)[0]
    ids = llm.tokenizer.encode(PROMPT)
    assert len(out.logprobs) == len(out.token_ids) == 8
    total = 0.0
    for i, (token, position) in enumerate(zip(out.token_ids, out.logprobs)):
        context = ids + out.token_ids[:i]
        check_position(position, token, float64_logprobs(llm, context), 3, llm.engine.loaded.model.reference_logits(context))
        total += float(float64_logprobs(llm, context)[token])
    assert math.isclose(out.cumulative_logprob, total, abs_tol=1e-4)
    zero = generate(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=3, logprobs=0))[0]
    assert all(len(p) == 1 for p in zero.logprobs)
    none = generate(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=3))[0]
    assert none.logprobs is None and none.cumulative_logprob is None


def test_processed_logprobs_are_the_distribution_sampled_from():
    """logprobs_mode="processed_logprobs" (vLLM's): log_softmax of the processed logits (the options'
    definitions) over temperature; the tokens are those of the raw mode's run (same seed)."""
    temperature = 0.8
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=6, ignore_eos=True, logprobs=3, logit_bias={7: 2.5}, **PENALTIES)
    raw = generate(toy_llm(), [PROMPT], params)[0]
    llm = toy_llm(logprobs_mode="processed_logprobs")
    out = generate(llm, [PROMPT], params)[0]
    assert out.token_ids == raw.token_ids
    ids = llm.tokenizer.encode(PROMPT)
    for i, (token, position) in enumerate(zip(out.token_ids, out.logprobs)):
        output = out.token_ids[:i]
        x = processed_logits(llm.engine.loaded.model.reference_logits(ids + output).double(), params, ids, output, llm.tokenizer) / temperature
        check_position(position, token, x.log_softmax(-1), 3, x)
    greedy_out = generate(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=2, logprobs=1, logit_bias={7: 100.0}))[0]
    assert greedy_out.token_ids[0] == 7 and greedy_out.logprobs[0][7].logprob > -1e-5, "the bias makes token 7 all but certain"
    with pytest.raises(InvalidRequestError, match="logprobs_mode must be one of raw_logprobs, processed_logprobs, got 'processed'"):
        toy_llm(logprobs_mode="processed")


def test_prompt_logprobs_in_chunks_and_without_prefix_cache_reads():
    llm = toy_llm(max_num_batched_tokens=5)
    prompt = "The quick brown fox jumps"
    llm.generate([prompt + " over"], greedy(max_tokens=2), use_tqdm=False)  # leaves the prompt's blocks in the prefix cache
    out = llm.generate([prompt, "abc"], [greedy(max_tokens=2, prompt_logprobs=2), greedy(max_tokens=2)], use_tqdm=False)
    first = out[0]
    assert first.num_cached_tokens == 0, "a request with prompt_logprobs computes every position"
    ids = llm.tokenizer.encode(prompt)
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        check_position(first.prompt_logprobs[p], ids[p], float64_logprobs(llm, ids[:p]), 2, llm.engine.loaded.model.reference_logits(ids[:p]))
    assert out[1].prompt_logprobs is None


def test_prompt_logprobs_survive_preemption():
    # Few pages: the requests preempt each other; the preempted one is recomputed, its prompt logprobs kept once.
    llm = toy_llm(num_kv_blocks=8, block_size=4)
    prompts = ["abcdefghijk", "lmnopqrstuv", "wxyz ABCDEF"]
    outs = llm.generate(prompts, greedy(max_tokens=10, prompt_logprobs=1, logprobs=1, **PENALTIES), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        alone = toy_llm().generate([prompt], greedy(max_tokens=10, prompt_logprobs=1, logprobs=1, **PENALTIES), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert out.prompt_logprobs == alone.prompt_logprobs and out.outputs[0].logprobs == alone.outputs[0].logprobs


def test_options_do_not_leak_into_other_requests_of_the_batch():
    prompts = ["Hello there", "abc abc", "xyz", "The quick brown"]
    params = [greedy(**PENALTIES), greedy(), greedy(bad_words=["aa"], logit_bias={9: 1.0}), greedy(allowed_token_ids=[3, 4, 5, 6])]
    together = generate(toy_llm(max_num_batched_tokens=6), prompts, params)
    for prompt, p, out in zip(prompts, params, together):
        assert out.token_ids == generate(toy_llm(), [prompt], p)[0].token_ids


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_and_overlap_keep_the_tokens(overlap):
    """The penalty history on the device, refilled after a preemption; with overlap scheduling a
    step is launched before the host knows the newest token (bad words read it on the device)."""
    prompts = ["Hello there", "abcdefghij", "The quick"]
    params = [greedy(max_tokens=14, **PENALTIES), greedy(max_tokens=14, bad_words=["aa", "ah", " B"], logprobs=2), greedy(max_tokens=14, min_tokens=3)]
    want = [generate(toy_llm(), [p], sp)[0] for p, sp in zip(prompts, params)]
    llm = toy_llm(num_kv_blocks=9, block_size=4, overlap=overlap)
    got = generate(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0 or overlap
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[1].logprobs == want[1].logprobs
    assert [o.token_ids for o in want] == [oracle_greedy(toy_llm(), p, sp, 14) for p, sp in zip(prompts, params)]


def test_overlap_scheduling_reads_the_newest_token_on_the_device():
    """Launched ahead, a decode step's newest token is not on the host yet: the bad word "km" must
    still ban "m" right after a "k", and the penalties count every token."""
    params = [greedy(max_tokens=16, bad_words=["km"], logprobs=1), greedy(max_tokens=16, **PENALTIES)]
    llm = toy_llm(overlap=True)
    got = generate(llm, [PROMPT, PROMPT], params)
    assert llm.engine.overlap.steps_ahead > 10
    for out, p in zip(got, params):
        assert out.token_ids == oracle_greedy(llm, PROMPT, p, 16)
    assert "km" not in got[0].text and got[0].logprobs == generate(toy_llm(), [PROMPT], params[0])[0].logprobs


def test_requests_without_options_run_no_processing_op(monkeypatch):
    llm = toy_llm()
    runner = llm.engine.runner
    calls = []
    for name in ("apply_penalties", "apply_token_bias", "apply_token_bitmask", "gather_logprobs"):
        original = getattr(runner.ops, name)
        monkeypatch.setattr(runner.ops, name, lambda *a, _n=name, _f=original, **k: calls.append(_n) or _f(*a, **k))
    generate(llm, [PROMPT, "abc"], SamplingParams(temperature=0.7, top_k=5, max_tokens=4, seed=1))
    assert calls == []
    generate(llm, [PROMPT, "abc"], [greedy(max_tokens=2, **PENALTIES), greedy(max_tokens=2, logprobs=1)])
    assert set(calls) == {"apply_penalties", "gather_logprobs"}


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(logit_bias={71: 1.0}), "logit_bias has token id 71, outside the vocabulary"),
        (dict(allowed_token_ids=[3, 99]), "allowed_token_ids has token id 99, outside the vocabulary"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_one_line_errors(options, message):
    with pytest.raises(ValueError, match=message):
        toy_llm().generate([PROMPT], greedy(**options), use_tqdm=False)


def test_bad_words_need_a_tokenizer():
    llm = toy_llm()
    llm.engine.tokenizer = None
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        llm.generate([{"prompt_token_ids": [3, 4]}], greedy(bad_words=["x"]), use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
        (dict(logit_bias={"3": 1.0}), "logit_bias must be a dict of token ids"),
        (dict(logit_bias={3: float("inf")}), "logit_bias"),
        (dict(logit_bias=[(3, 1.0)]), "logit_bias"),
        (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
        (dict(min_tokens=20, max_tokens=10), r"min_tokens \(20\) must be at most max_tokens \(10\)"),
        (dict(bad_words="word"), "bad_words must be a list"),
        (dict(bad_words=[" "]), "bad_words"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
        (dict(allowed_token_ids=[-3]), "allowed_token_ids"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output must be True or False"),
        (dict(logprobs=21), r"logprobs must be None or an integer in \[0, 20\]"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(logprobs=True), "logprobs"),
    ],
)
def test_bad_option_values_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value)


def test_penalty_history_slots_are_filled_from_the_tokens_and_reclaimed():
    """A slot holds its request's output counts and prompt bits; a request that lost its slot (it
    stopped running and another took it) gets another, refilled from its tokens."""
    from deepinfer.engine.penalty_history import PenaltyHistory
    from deepinfer.engine.sequence import Sequence, SequenceStatus
    from deepinfer.ops.penalties import unpack_bits

    history = PenaltyHistory(num_slots=2, vocab_size=40, device=torch.device("cpu"))
    seqs = [Sequence(i, [3, 33, 3, 39], SamplingParams(**PENALTIES), seed=0) for i in range(3)]
    for seq in seqs:
        seq.status = SequenceStatus.RUNNING
    seqs[0].token_ids += [5, 5, 7]
    a, b = history.slot(seqs[0]), history.slot(seqs[1])
    assert {a, b} == {0, 1} and history.slot(seqs[0]) == a
    assert history.output_counts[a].tolist() == [2 if v == 5 else 1 if v == 7 else 0 for v in range(40)]
    assert unpack_bits(history.prompt_mask[a : a + 1], 40)[0].nonzero().flatten().tolist() == [3, 33, 39]
    with pytest.raises(RuntimeError, match="all 2 penalty history slots are held by running requests"):
        history.slot(seqs[2])
    seqs[0].status = SequenceStatus.WAITING  # preempted: its slot may go
    assert history.slot(seqs[2]) == a and history.output_counts[a].sum() == 0
    history.record(torch.tensor([a, -1]), torch.tensor([9, 9]))
    assert history.output_counts[a, 9] == 1 and history.output_counts[b, 9] == 0
    seqs[0].status, seqs[1].status = SequenceStatus.RUNNING, SequenceStatus.FINISHED
    assert history.slot(seqs[0]) == b and history.output_counts[b].tolist() == [2 if v == 5 else 1 if v == 7 else 0 for v in range(40)]


def test_an_eager_step_of_greedy_requests_tells_the_backend_so(monkeypatch):
    """The engine knows the requests' temperatures on the host: a step whose rows are all greedy passes all_greedy (the
    backend then runs only the greedy path), a step with one sampled row does not; the tokens are those of the flag unset."""
    llm = toy_llm(enforce_eager=True)
    runner, seen = llm.engine.runner, []
    sample = runner.ops.sample

    def spy(*args, all_greedy=False, **kwargs):
        seen.append(all_greedy)
        return sample(*args, all_greedy=all_greedy, **kwargs)

    monkeypatch.setattr(runner.ops, "sample", spy)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    flagged = [o.outputs[0].token_ids for o in llm.generate([PROMPT, "another prompt"], greedy, use_tqdm=False)]
    assert seen and all(seen)
    seen.clear()
    mixed = llm.generate([PROMPT, "another prompt"], [greedy, SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True)], use_tqdm=False)
    assert seen and not any(seen)
    monkeypatch.setattr(runner.ops, "sample", lambda *args, all_greedy=False, **kwargs: sample(*args, **kwargs))
    assert [o.outputs[0].token_ids for o in llm.generate([PROMPT, "another prompt"], greedy, use_tqdm=False)] == flagged
    assert mixed[0].outputs[0].token_ids == flagged[0]
