"""The engine on the real tiny model (the embedded DeepSeek-V3 default, reference backend, float32):
greedy tokens must not depend on how requests are batched, chunked, cached or preempted.

The oracle needs no decode step and no cache reuse: each next token is the argmax of a fresh
single-prompt prefill of the whole sequence so far (prefix caching off)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.engine.llm import LLM
from deepinfer.engine.llm_engine import EngineConfig, LLMEngine

from engine.fresh_prefill import greedy_by_fresh_prefill, tokens

MAX_TOKENS = 5
SHARED = "In a quiet village by the sea, an old fisherman told stories about the storms of his youth and"  # > 16 tokens
# 15, 13, 23 and 14 tokens: the short ones cross into a second 16-token block while decoding.
PROMPTS = [
    "Hello, my name is Alice and I live in a small town near",
    "The capital of France is a city that many people visit in",
    SHARED + " the lighthouse",
    "1 2 3 4 5 6 7",
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_llm(loaded, runtime, **options) -> LLM:
    return LLM.from_engine(LLMEngine(loaded, runtime, torch.float32, EngineConfig(**options)))


@pytest.fixture(scope="module")
def oracle(loaded, runtime):
    return greedy_by_fresh_prefill(make_llm(loaded, runtime, enable_prefix_caching=False, num_kv_blocks=64), loaded.tokenizer, PROMPTS, MAX_TOKENS)


def test_block_size_comes_from_the_backend(loaded, runtime):
    assert make_llm(loaded, runtime, num_kv_blocks=8).engine.block_size == runtime.backend.kv_block_size == 16


def test_all_together_and_one_at_a_time(loaded, runtime, oracle):
    assert tokens(make_llm(loaded, runtime, num_kv_blocks=64).generate(PROMPTS, GREEDY, use_tqdm=False)) == oracle
    llm = make_llm(loaded, runtime, num_kv_blocks=64, enable_prefix_caching=False)
    assert [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS] == oracle


def test_chunked_prefill_with_a_16_token_budget(loaded, runtime, oracle):
    llm = make_llm(loaded, runtime, num_kv_blocks=64, max_num_batched_tokens=16)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == oracle
    # Alone under a budget of 8, the 23-token prompt takes two steps in which nothing samples.
    llm = make_llm(loaded, runtime, num_kv_blocks=64, max_num_batched_tokens=8)
    assert llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == oracle[2]


def test_after_a_prefix_cache_hit(loaded, runtime, oracle):
    llm = make_llm(loaded, runtime, num_kv_blocks=64)
    llm.generate(SHARED + " the harbour", GREEDY, use_tqdm=False)  # leaves the shared prefix in the cache
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert out[2].num_cached_tokens >= 16
    assert tokens(out) == oracle


def test_after_forced_preemption(loaded, runtime, oracle):
    # 5 blocks of 16 tokens: the four prompts take all of them, and three must grow into a new block.
    llm = make_llm(loaded, runtime, num_kv_blocks=5)
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens(out) == oracle


def test_seeded_sampling_on_the_model(loaded, runtime):
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=4, seed=7, ignore_eos=True)
    alone = make_llm(loaded, runtime, num_kv_blocks=64).generate(PROMPTS[0], params, use_tqdm=False)[0]
    crowd = make_llm(loaded, runtime, num_kv_blocks=64, max_num_batched_tokens=16).generate(PROMPTS, params, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == crowd.outputs[0].token_ids
    assert alone.outputs[0].text == loaded.tokenizer.decode(alone.outputs[0].token_ids)


def test_stop_string_with_the_real_tokenizer(loaded, runtime):
    llm = make_llm(loaded, runtime, num_kv_blocks=64)
    full = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    decode = loaded.tokenizer.decode
    start = len(decode(full.token_ids[:4]))
    stop = full.text[start : start + 2]  # characters of the 5th token or later
    assert stop.strip(), f"pick another prompt: {full.text!r}"
    first_k = next(k for k in range(1, 9) if stop in decode(full.token_ids[:k]))
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, stop=stop), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == full.token_ids[:first_k]
    assert out.text == full.text[: full.text.find(stop)]


def test_every_llm_option_reaches_the_engine_config_by_name(tmp_path, monkeypatch):
    """LLM passes its engine options by keyword: a field added to or moved in EngineConfig cannot
    shift the others."""
    import dataclasses

    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    options = dict(
        max_num_seqs=3, max_num_batched_tokens=48, num_kv_blocks=20, kv_cache_memory_gib=0.5, enable_prefix_caching=False,
        max_model_len=100, seed=11, enforce_eager=True, eplb_interval=4, kv_cache_dtype="fp8", deterministic=True, speculative="mtp:2",
        overlap=False, gpu_memory_utilization=0.5, mixed_steps=False, logprobs_mode="processed_logprobs",
        grammar_compile_timeout_s=7.5, grammar_cache_size=5, max_grammar_bytes=4096, kv_offload_cpu_gib=0.25, kv_offload_dir=str(tmp_path / "kv"),
        kv_offload_disk_gib=2.0, kv_offload_ttl_s=60.0, kv_store_url="redis://127.0.0.1:1/0",
    )  # fmt: skip
    assert set(options) == {f.name for f in dataclasses.fields(EngineConfig)}  # every field, each a different value
    import deepinfer.kv_tiers.open_tiers as open_tiers_mod

    monkeypatch.setattr(open_tiers_mod, "open_tiers", lambda engine: None)  # (prefix caching is off here: tiers are tests/kv_tiers')
    llm = LLM(backend="reference", dtype="float32", announce=False, **options)
    want = EngineConfig(**options)
    want.validate()  # (parses speculative)
    assert llm.engine.config == want
