"""The FP8 KV cache (`kv_cache_dtype="fp8"`) in the engine, on the embedded tiny DeepSeek-V3 (reference
backend, float32): the cache is e4m3 rows with a per-token scale, it takes about half the bytes of a
bfloat16 cache per token in the budget, and greedy tokens do not depend on how the engine runs the
prompts (batched, chunked, after a prefix-cache hit): every attention, prefill and decode alike,
reads the same quantised rows. The oracle: each next token from a fresh prefill of the whole
sequence so far, with the FP8 cache."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.engine.llm import LLM
from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
from deepinfer.engine.model_runner import kv_block_bytes
from deepinfer.engine.sampling_params import InvalidRequestError

from cli_helpers import run_cli
from engine.fresh_prefill import greedy_by_fresh_prefill, tokens

MAX_TOKENS = 5
PROMPTS = [
    "Hello, my name is Alice and I live in a small town near",
    "In a quiet village by the sea, an old fisherman told stories about the storms of his youth and the lighthouse",
    "1 2 3 4 5 6 7",
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_llm(loaded, runtime, **options) -> LLM:
    return LLM.from_engine(LLMEngine(loaded, runtime, torch.float32, EngineConfig(kv_cache_dtype="fp8", **options)))


@pytest.fixture(scope="module")
def oracle(loaded, runtime):
    return greedy_by_fresh_prefill(make_llm(loaded, runtime, enable_prefix_caching=False, num_kv_blocks=64), loaded.tokenizer, PROMPTS, MAX_TOKENS)


def test_the_caches_are_fp8_rows_with_their_scale(loaded, runtime):
    llm = make_llm(loaded, runtime, num_kv_blocks=8)
    cache = llm.engine.runner.kv_caches[0]
    assert cache.dtype == torch.float8_e4m3fn and cache.shape == (8, 16, loaded.config.kv_cache_width + 16)


def test_greedy_tokens_match_the_fp8_oracle_batched_chunked_and_after_a_hit(loaded, runtime, oracle):
    assert tokens(make_llm(loaded, runtime, num_kv_blocks=64).generate(PROMPTS, GREEDY, use_tqdm=False)) == oracle
    chunked = make_llm(loaded, runtime, num_kv_blocks=64, max_num_batched_tokens=8)
    assert tokens(chunked.generate(PROMPTS, GREEDY, use_tqdm=False)) == oracle
    again = chunked.generate(PROMPTS, GREEDY, use_tqdm=False)  # every full block hits
    assert again[1].num_cached_tokens >= 16 and tokens(again) == oracle


def test_the_budget_counts_half_the_bytes_per_token(loaded, runtime):
    model = loaded.model
    width = loaded.config.kv_cache_width  # 80 in the tiny model, 576 in DeepSeek-V3 (592 / 1152 = 51.4%)
    assert kv_block_bytes(model, 64, torch.float8_e4m3fn) == 64 * (width + 16) * model.num_layers
    assert kv_block_bytes(model, 64, torch.float8_e4m3fn) / kv_block_bytes(model, 64, torch.bfloat16) == (width + 16) / (2 * width)
    budget = int(0.01 * 2**30)
    fp8 = make_llm(loaded, runtime, kv_cache_memory_gib=0.01).engine.num_kv_blocks
    full = LLMEngine(loaded, runtime, torch.float32, EngineConfig(kv_cache_memory_gib=0.01)).num_kv_blocks
    assert (fp8, full) == (budget // kv_block_bytes(model, 16, torch.float8_e4m3fn), budget // kv_block_bytes(model, 16, torch.float32))


def test_unknown_kv_cache_dtype_is_one_clear_error(loaded, runtime):
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, got 'fp8_e5m2'"):
        LLMEngine(loaded, runtime, torch.float32, EngineConfig(kv_cache_dtype="fp8_e5m2"))


def test_cli_flag(tmp_path):
    env = {**os.environ, "DEEPINFER_CACHE": str(tmp_path)}
    bad = run_cli("run", "--kv-cache-dtype", "int8", "--prompt", "hi", env=env)
    assert bad.returncode == 2 and "--kv-cache-dtype: invalid choice: 'int8'" in bad.stderr
    ok = run_cli("run", "--backend", "reference", "--kv-cache-dtype", "fp8", "--prompt", "hi", "--max-tokens", "3", "--no-progress", env=env)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip()


def test_kernels_are_chosen_knowing_the_cache_format(tmp_path, monkeypatch):
    """LLM tells the resolver whether the cache is FP8 (ModelFacts.kv_cache_fp8), so a kernel that
    cannot read FP8 rows (the ascend torch_npu attention fast path) is never chosen for one."""
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    for dtype, fp8 in (("fp8", True), ("auto", False)):
        llm = LLM(backend="reference", dtype="float32", kv_cache_dtype=dtype, num_kv_blocks=8, announce=False)
        assert llm.engine.runtime.ops.ctx.model.kv_cache_fp8 is fp8
