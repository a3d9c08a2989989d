"""The whole engine (scheduler, block manager, model runner, sampling, stop rules, API) on a toy
model that reads its context back from the paged KV cache. The oracle recomputes every token from
the token list with no cache: any paging, prefix-cache, chunking or preemption bug shows as a
different token."""

from __future__ import annotations

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.engine.sampling_params import InvalidRequestError

from engine.toy_engine import ToyTokenizer, greedy_reference, reference_runtime, toy_llm

PROMPTS = [
    "Hello there",
    "a",
    "The quick brown fox jumps over the lazy dog",
    "0123456789 0123456789 abc",
    "xyz",
]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def expected(llm, prompts, max_tokens=10):
    model, tok = llm.engine.loaded.model, llm.tokenizer
    return [greedy_reference(model, tok.encode(p), max_tokens, eos=None) for p in prompts]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_matches_the_cacheless_oracle_in_every_batching(block_size):
    want = expected(toy_llm(block_size), PROMPTS)
    together = toy_llm(block_size).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(together) == want
    one_llm = toy_llm(block_size)
    assert [one_llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS] == want
    chunked = toy_llm(block_size, max_num_batched_tokens=3)
    assert tokens(chunked.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    one_seq_at_a_time = toy_llm(block_size, max_num_seqs=1)
    assert tokens(one_seq_at_a_time.generate(PROMPTS, GREEDY, use_tqdm=False)) == want


def test_prefix_cache_hits_give_the_same_tokens():
    shared = "The quick brown fox jumps over the lazy dog and "
    prompts = [shared + "runs", shared + "sleeps", shared + "runs"]
    llm = toy_llm(block_size=4, max_num_seqs=1)  # one at a time: each later prompt finds the prefix computed
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected(llm, prompts)
    cached = [o.num_cached_tokens for o in outputs]
    assert cached[0] == 0 and cached[1] == len(shared) // 4 * 4
    assert cached[2] == (len(prompts[2]) - 1) // 4 * 4, "an identical prompt reuses all but its last block"
    # Decode blocks are cached too: the first request's prompt + generated tokens, run again as a prompt.
    again = {"prompt_token_ids": outputs[0].prompt_token_ids + outputs[0].outputs[0].token_ids}
    out = llm.generate(again, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == (len(again["prompt_token_ids"]) - 1) // 4 * 4
    assert out.outputs[0].token_ids == greedy_reference(llm.engine.loaded.model, again["prompt_token_ids"], 10, eos=None)


def test_preemption_by_recompute_gives_the_same_tokens():
    prompts = PROMPTS * 2
    llm = toy_llm(block_size=4, num_kv_blocks=16)  # 64 token slots for 10 requests of up to 53 tokens
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics["num_preemptions"] for o in outputs) == llm.engine.scheduler.num_preemptions
    assert tokens(outputs) == expected(llm, prompts)
    assert llm.engine.block_manager.num_free_blocks == 16, "every block is back"


def test_prefix_caching_off_gives_the_same_tokens():
    llm = toy_llm(block_size=4, enable_prefix_caching=False, num_kv_blocks=16)
    outputs = llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected(llm, PROMPTS * 2) and all(o.num_cached_tokens == 0 for o in outputs)


def test_outputs_come_back_in_input_order_while_the_stream_yields_in_finish_order():
    llm = toy_llm()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 2, 5)]
    prompts = ["abc", "def", "ghi"]
    stream = list(llm.generate_iter(prompts, params, use_tqdm=False))
    assert [index for index, _ in stream] == [1, 2, 0]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [9, 2, 5]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    assert [o.request_id for o in outputs] == ["3", "4", "5"], "request ids count on across calls"


def test_prompt_forms():
    llm = toy_llm()
    ids = llm.tokenizer.encode("hello")
    outs = llm.generate(["hello", {"prompt": "hello"}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids] * 3
    assert [o.prompt for o in outs] == ["hello", "hello", None]
    assert len(set(map(tuple, tokens(outs)))) == 1
    single = llm.generate("hello", GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def greedy_text(llm, prompt, n=10):
    want = expected(llm, [prompt], n)[0]
    return want, llm.tokenizer.decode(want)


def test_stop_string_cuts_the_text_and_stops():
    llm = toy_llm()
    want, text = greedy_text(llm, "The quick brown fox")
    stop = text[4:6]  # completed by the 6th token at the latest
    first = text.find(stop)
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=10, stop=["zzzz", stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:first]
    assert out.token_ids == want[: first + len(stop)], "token_ids run to the token that completed the stop string"


def test_stop_token_ids_and_eos_end_with_the_token_left_out_of_the_text():
    llm = toy_llm()
    want, text = greedy_text(llm, "Hello there")
    stop_id = want[3]
    cut = want.index(stop_id)
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.token_ids == want[: cut + 1] and out.text == llm.tokenizer.decode(want[:cut])
    # EOS: make the toy's 4th greedy token the end-of-sequence token.
    llm.engine.eos_token_ids = frozenset({stop_id})
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", None) and out.token_ids == want[: cut + 1]
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == want


def test_max_tokens_and_model_length_end_with_length():
    llm = toy_llm(max_position_embeddings=16)
    out = llm.generate("abcdefghij", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 6  # 10 + 6 = 16 tokens
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3


def sampled(llm, prompts, params):
    return tokens(llm.generate(prompts, params, use_tqdm=False))


def test_seeded_sampling_repeats_and_ignores_the_rest_of_the_batch():
    # Hot enough that the noise, and so the seed and the position, decide most tokens.
    params = SamplingParams(temperature=3.0, top_k=40, top_p=0.95, min_p=0.01, max_tokens=12, seed=1234, ignore_eos=True)
    alone = sampled(toy_llm(), ["Hello there"], params)[0]
    crowd = sampled(toy_llm(max_num_batched_tokens=4), ["abc", "Hello there", "xyz xyz"], params)[1]
    assert alone == crowd == sampled(toy_llm(), ["Hello there"], params)[0]
    other_seed = SamplingParams(temperature=3.0, top_k=40, top_p=0.95, min_p=0.01, max_tokens=12, seed=99, ignore_eos=True)
    assert sampled(toy_llm(), ["Hello there"], other_seed)[0] != alone
    # The oracle: the op applied to the cacheless logits, token by token, at the token's position.
    llm = toy_llm()
    ids = llm.tokenizer.encode("Hello there")
    ops, want = reference_runtime(4).ops, []
    for _ in range(12):
        logits = llm.engine.loaded.model.reference_logits(ids)[None]
        tok = int(ops.sample(logits, torch.tensor([3.0]), torch.tensor([40], dtype=torch.int32), torch.tensor([0.95]), torch.tensor([0.01]),
                             torch.tensor([1234]), torch.tensor([len(ids)])))
        ids.append(tok)
        want.append(tok)
    assert alone == want


def test_unseeded_requests_derive_their_seed_from_the_engine_seed():
    params = SamplingParams(temperature=3.0, max_tokens=8, ignore_eos=True)
    runs = [sampled(toy_llm(seed=s), ["Hello there", "Hello there"], params) for s in (0, 0, 1)]
    assert runs[0] == runs[1], "same LLM seed: same tokens"
    assert runs[0][0] != runs[0][1], "two requests get different seeds"
    assert runs[0] != runs[2]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens="5"), "max_tokens"),
        (dict(seed=2**64), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_bad_sampling_params_raise_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_requests_raise_before_anything_runs():
    llm = toy_llm(num_kv_blocks=6, block_size=4, max_position_embeddings=64)
    checks = [
        (["ok", {"prompt_token_ids": []}], "prompt 1 is empty"),
        ([{"prompt_token_ids": [1, 999]}], "outside the vocabulary"),
        (["a" * 64], "maximum length is 64"),
        (["a" * 10], "needs 7 KV blocks"),  # 10 + 16 tokens > 6 blocks of 4
        ([3], "must be a string"),
    ]
    for prompts, message in checks:
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate(prompts, SamplingParams(max_tokens=16), use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.generate(["ab"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].finish_reason is not None


def test_an_abandoned_stream_leaves_nothing_behind():
    llm = toy_llm(num_kv_blocks=32)
    stream = llm.generate_iter(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished() and llm.engine.block_manager.num_free_blocks == 32
    assert tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == expected(llm, PROMPTS[:2])


def test_toy_tokenizer_round_trips():
    tok = ToyTokenizer()
    assert tok.decode(tok.encode("Hello, World!")) == "Hello, World!"
