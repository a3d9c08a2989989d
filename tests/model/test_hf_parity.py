"""deepinfer's DeepSeek V2/V3 against transformers' own modeling code on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.loader import load_model

from model.model_oracle import PROMPTS, PagedRunner, hf_greedy, hf_last_logits, rel_err

TOL = 1e-4


@pytest.fixture(scope="module", params=["v3", "v2"])
def pair(request, ops):
    folder, hf = request.getfixturevalue(f"{request.param}_checkpoint")
    return load_model(str(folder), ops, "cpu", torch.float32), hf


def test_config_shape_of_the_oracles(pair):
    loaded, _ = pair
    c = loaded.config
    assert [c.is_moe_layer(i) for i in range(c.num_hidden_layers)] == [False, True, True]
    assert c.rope_scaling is not None and c.rope_scaling["rope_type"] == "yarn"
    if c.model_type == "deepseek_v3":
        assert c.uses_correction_bias and c.q_lora_rank == 48 and c.routing_groups == (4, 2)
    else:
        assert not c.uses_correction_bias and c.q_lora_rank is None and c.scoring_func == "softmax"


def test_prefill_logits_match_transformers(pair):
    """All prompts in one prefill step (naive MLA path); each last-position row against HF."""
    loaded, hf = pair
    logits = PagedRunner(loaded.model).step({i: p for i, p in enumerate(PROMPTS)}, is_prefill=True)
    assert logits.dtype == torch.float32 and logits.shape == (len(PROMPTS), loaded.config.vocab_size)
    for row, prompt in zip(logits, PROMPTS):
        assert rel_err(row, hf_last_logits(hf, prompt)) < TOL


def test_decode_logits_match_transformers(pair):
    """Decode steps (absorbed MLA path), two sequences together, on forced tokens."""
    loaded, hf = pair
    runner = PagedRunner(loaded.model)
    prompts = [PROMPTS[1], PROMPTS[2]]
    runner.step({0: prompts[0], 1: prompts[1]}, is_prefill=True)
    forced = [[11, 500, 3], [999, 2, 77]]
    for k in range(3):
        logits = runner.step({0: [forced[0][k]], 1: [forced[1][k]]}, is_prefill=False)
        for s in range(2):
            assert rel_err(logits[s], hf_last_logits(hf, prompts[s] + forced[s][: k + 1])) < TOL


def test_greedy_tokens_match_transformers(pair):
    loaded, hf = pair
    ours = PagedRunner(loaded.model).greedy(PROMPTS, steps=16)
    for prompt, tokens in zip(PROMPTS, ours):
        assert tokens == hf_greedy(hf, prompt, 16)


def test_chunked_prefill_equals_one_shot(pair):
    """A prompt prefilled in two chunks (the second over a cached prefix) gives the one-shot logits;
    a chunk step may also carry another sequence's whole prompt."""
    loaded, _ = pair
    prompt = PROMPTS[2]
    whole = PagedRunner(loaded.model).step({0: prompt}, is_prefill=True)[0]
    runner = PagedRunner(loaded.model, seed=7)
    assert runner.step({0: prompt[:9]}, is_prefill=True, logits_for=[]).shape[0] == 0
    chunked = runner.step({1: PROMPTS[1], 0: prompt[9:]}, is_prefill=True)
    assert rel_err(chunked[1], whole) < 1e-5
    assert rel_err(chunked[0], PagedRunner(loaded.model).step({0: PROMPTS[1]}, is_prefill=True)[0]) < 1e-5


def test_multi_token_decode_step(pair):
    """A decode step with S=2 new tokens per sequence (speculative verification's shape)."""
    loaded, hf = pair
    runner = PagedRunner(loaded.model)
    runner.step({0: PROMPTS[1], 1: PROMPTS[2]}, is_prefill=True)
    logits = runner.step({0: [8, 9], 1: [10, 11]}, is_prefill=False)
    assert rel_err(logits[0], hf_last_logits(hf, PROMPTS[1] + [8, 9])) < TOL
    assert rel_err(logits[1], hf_last_logits(hf, PROMPTS[2] + [10, 11])) < TOL


VARIANTS = {
    # V3 with a plain q_proj, rotate-half RoPE weights, plain RoPE, every layer MoE, no groups
    "v3_plain": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, first_k_dense_replace=0, n_group=1, topk_group=1,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    # V2 with greedy routing over all experts and tied embeddings
    "v2_greedy_tied": ("deepseek_v2", dict(topk_method="greedy", n_group=None, topk_group=None, tie_word_embeddings=True,
                                           q_lora_rank=40)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_transformers(variant, tmp_path, ops):
    from model.model_oracle import build_hf

    model_type, overrides = VARIANTS[variant]
    hf = build_hf(model_type, tmp_path, seed=5, **overrides)
    loaded = load_model(str(tmp_path), ops, "cpu", torch.float32)
    runner = PagedRunner(loaded.model)
    logits = runner.step({0: PROMPTS[2], 1: PROMPTS[1]}, is_prefill=True)
    assert rel_err(logits[0], hf_last_logits(hf, PROMPTS[2])) < TOL
    assert rel_err(logits[1], hf_last_logits(hf, PROMPTS[1])) < TOL
    logits = runner.step({0: [3], 1: [4]}, is_prefill=False)
    assert rel_err(logits[0], hf_last_logits(hf, PROMPTS[2] + [3])) < TOL
    assert rel_err(logits[1], hf_last_logits(hf, PROMPTS[1] + [4])) < TOL
