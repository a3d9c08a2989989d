"""ModelConfig from HF config.json dicts: routing defaults, rope forms, softmax scale, layer kinds."""

from __future__ import annotations

import math

import pytest

from deepinfer.model.config import ModelConfig
from deepinfer.model.errors import LoadError

BASE = dict(
    model_type="deepseek_v3", vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=6, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
)
YARN = {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


def test_yarn_from_rope_scaling_or_rope_parameters_gives_the_same_config():
    old = ModelConfig.from_dict({**BASE, "rope_theta": 5000.0, "rope_scaling": {"type": "yarn", **YARN}})
    new = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, **YARN}})
    assert old.rope_theta == new.rope_theta == 5000.0
    assert old.rope_scaling == new.rope_scaling and old.rope_scaling["rope_type"] == "yarn"
    m = 0.1 * 0.707 * math.log(40.0) + 1.0
    assert old.softmax_scale == pytest.approx(24**-0.5 * m * m, rel=1e-12)


def test_plain_rope_softmax_scale():
    c = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    assert c.rope_scaling is None and c.softmax_scale == pytest.approx(24**-0.5, rel=1e-12)


def test_moe_layers_follow_first_k_dense_and_layer_freq():
    c = ModelConfig.from_dict({**BASE, "first_k_dense_replace": 1, "moe_layer_freq": 2})
    assert [c.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    dense = ModelConfig.from_dict({**BASE, "n_routed_experts": None})
    assert not any(dense.is_moe_layer(i) for i in range(6))


def test_routing_defaults_per_model_type():
    v3 = ModelConfig.from_dict(BASE)
    assert (v3.topk_method, v3.scoring_func, v3.norm_topk_prob, v3.uses_correction_bias) == ("noaux_tc", "sigmoid", True, True)
    v2 = ModelConfig.from_dict({**BASE, "model_type": "deepseek_v2", "n_group": 4, "topk_group": 2})
    assert (v2.topk_method, v2.scoring_func, v2.uses_correction_bias, v2.routing_groups) == ("greedy", "softmax", False, (1, 1))
    grouped = ModelConfig.from_dict({**BASE, "model_type": "deepseek_v2", "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2})
    assert grouped.routing_groups == (4, 2) and not grouped.uses_correction_bias


def test_eos_and_quantization():
    c = ModelConfig.from_dict({**BASE, "eos_token_id": [1, 7], "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert c.eos_token_ids == (1, 7) and c.quantization is not None


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"model_type": "llama"}, "'llama'"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"quantization_config": {"quant_method": "awq"}}, "awq"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, "weight_block_size"),
        ({"topk_method": "random"}, "random"),
        ({"n_group": 3}, "n_group=3"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_bad_configs_are_load_errors(change, needle):
    with pytest.raises(LoadError, match="config.json") as info:
        ModelConfig.from_dict({**BASE, **change})
    assert needle in str(info.value)
