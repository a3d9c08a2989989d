"""deepinfer's DeepSeek-V4 (reference backend, float32) against transformers' DeepseekV4ForCausalLM decoding
token by token: the last prompt position's logits within 1e-4 relative and 12 greedy tokens identical, on tiny
random configs that cover every layer type, hash and routed MoE, YaRN on the compressed branches and prompts
longer than the window and than several compression windows, under both checkpoint namings."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams

from model_v4.oracle import TINY_CONFIGS, hf_reference, pick_prompt

PROMPT_LEN, NEW_TOKENS = 320, 12


def deepinfer_run(folder, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """(the logits the first token is sampled from, the 12 greedy tokens)."""
    llm = LLM(model=str(folder), backend="reference", dtype="float32")
    seen, sample = [], llm.engine.runner.ops.sample
    llm.engine.runner.ops.sample = lambda **kw: seen.append(kw["logits"][0].clone()) or sample(**kw)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=NEW_TOKENS, temperature=0), use_tqdm=False)
    return seen[0], out[0].outputs[0].token_ids


@pytest.mark.parametrize("config, names", [("mixed", "hf"), ("yarn", "deepseek"), ("flash_like", "hf")])
def test_logits_and_greedy_tokens_match_transformers_token_by_token(v4_checkpoint, config, names):
    folder = v4_checkpoint(config, names=names)
    prompt = pick_prompt(folder, PROMPT_LEN, NEW_TOKENS)
    want = hf_reference(folder, prompt, NEW_TOKENS)  # token by token: DeepSeek's causal semantics
    logits, tokens = deepinfer_run(folder, prompt)
    relative = float((logits - want["logits"]).abs().max() / want["logits"].abs().max())
    assert relative <= 1e-4, f"{config}: last-position logits differ by {relative:.2e} (relative)"
    assert tokens == want["tokens"]


def test_the_configs_cover_every_layer_and_mlp_type():
    layer_types = {t for c in TINY_CONFIGS.values() for t in c["layer_types"]}
    mlp_types = {t for c in TINY_CONFIGS.values() for t in c["mlp_layer_types"]}
    assert layer_types == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert mlp_types == {"hash_moe", "moe"}
    for c in TINY_CONFIGS.values():  # the prompts outgrow the window and several windows of every ratio
        assert PROMPT_LEN > c["sliding_window"] and PROMPT_LEN >= 4 * c["compress_rates"]["heavily_compressed_attention"]
