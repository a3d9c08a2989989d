"""config.json checked as a typed schema before anything is allocated: wrong types, ranges, nested
objects and relations each give one CheckpointError naming the file, the field, the value and what
is expected (issue 13, item 12)."""

from __future__ import annotations

import json
import math

import pytest

from deepinfer.errors import UserError
from deepinfer.model.config import CONFIG_FIELDS, ModelConfig
from deepinfer.model.errors import CheckpointError

BASE = dict(
    model_type="deepseek_v3", vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=6, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    bos_token_id=0, eos_token_id=1,
)  # fmt: skip
YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


def refused(change: dict, *needles: str) -> str:
    with pytest.raises(CheckpointError) as info:
        ModelConfig.from_dict({**BASE, **change}, source="/m/config.json")
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, UserError) and info.value.exit_code == 2
    assert message.startswith("/m/config.json: "), message
    for needle in needles:
        assert needle in message, message
    return message


@pytest.mark.parametrize(
    "change, needles",
    [
        # types: an int field takes a JSON integer only (not a float, a string or a boolean)
        ({"hidden_size": "abc"}, ['hidden_size is "abc"', "expected an integer >= 1"]),
        ({"hidden_size": 64.7}, ["hidden_size is 64.7", "expected an integer"]),
        ({"hidden_size": 64.0}, ["hidden_size is 64.0", "expected an integer"]),
        ({"num_hidden_layers": True}, ["num_hidden_layers is true", "expected an integer"]),
        ({"max_position_embeddings": 1e11}, ["max_position_embeddings is 100000000000.0", "expected an integer >= 2"]),
        ({"rms_norm_eps": "1e-6"}, ['rms_norm_eps is "1e-6"', "expected a finite number > 0"]),
        ({"tie_word_embeddings": 1}, ["tie_word_embeddings is 1", "expected true or false"]),
        ({"attention_bias": "false"}, ['attention_bias is "false"', "expected true or false"]),
        ({"eos_token_id": {"a": 1}}, ['eos_token_id is {"a": 1}', "expected an integer >= 0 or a list of them"]),
        ({"eos_token_id": [1, "2"]}, ["eos_token_id is [1, \"2\"]"]),
        ({"bos_token_id": -1}, ["bos_token_id is -1"]),
        # ranges
        ({"max_position_embeddings": -1}, ["max_position_embeddings is -1", "expected an integer >= 2"]),
        ({"max_position_embeddings": 0}, ["max_position_embeddings is 0", "expected an integer >= 2"]),
        ({"max_position_embeddings": 1}, ["max_position_embeddings is 1"]),
        ({"rms_norm_eps": -1}, ["rms_norm_eps is -1", "expected a finite number > 0"]),
        ({"rms_norm_eps": 0}, ["rms_norm_eps is 0"]),
        ({"rms_norm_eps": math.nan}, ["rms_norm_eps is NaN", "finite"]),
        ({"routed_scaling_factor": math.inf}, ["routed_scaling_factor is Infinity", "finite"]),
        ({"rope_theta": 1}, ["rope_theta is 1", "> 1"]),
        ({"vocab_size": 0}, ["vocab_size is 0"]),
        ({"num_attention_heads": -4}, ["num_attention_heads is -4"]),
        ({"n_routed_experts": -8}, ["n_routed_experts is -8"]),
        ({"moe_layer_freq": 0}, ["moe_layer_freq is 0"]),
        ({"routed_scaling_factor": 10**400}, ["routed_scaling_factor is 1000000", "finite"]),
        # nested objects of the wrong type, and their fields
        ({"rope_parameters": "yarn"}, ['rope_parameters is "yarn"', "expected an object"]),
        ({"rope_scaling": [1]}, ["rope_scaling is [1]", "expected an object"]),
        ({"rope_scaling": {**YARN, "factor": "abc"}}, ['rope_scaling.factor is "abc"', "expected a finite number > 0"]),
        ({"rope_scaling": {**YARN, "factor": 0}}, ["rope_scaling.factor is 0"]),
        ({"rope_scaling": {**YARN, "factor": None}}, ["required field rope_scaling.factor is missing"]),
        ({"rope_scaling": {**YARN, "original_max_position_embeddings": None}}, ["rope_scaling.original_max_position_embeddings is missing"]),
        ({"rope_scaling": {**YARN, "beta_fast": -32}}, ["rope_scaling.beta_fast is -32"]),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": "big", "factor": 4.0}}, ['rope_parameters.rope_theta is "big"']),
        ({"rope_parameters": {"rope_type": 3}}, ["rope_parameters.rope_type is 3", "one of default, yarn"]),
        ({"quantization_config": [1]}, ["quantization_config is [1]", "expected an object"]),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": "128"}}, ['quantization_config.weight_block_size is "128"']),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128.0, 128.0]}}, ["weight_block_size is [128.0, 128.0]"]),
        ({"quantization_config": {"weight_block_size": [128, 128]}}, ["required field quantization_config.quant_method is missing"]),
        # relations
        ({"qk_rope_head_dim": 7}, ["qk_rope_head_dim=7 must be even"]),
        ({"bos_token_id": 100}, ["bos_token_id=100 is not below vocab_size=100"]),
        ({"eos_token_id": [1, 500]}, ["eos_token_id 500 is not below vocab_size=100"]),
        ({"num_nextn_predict_layers": 10**12}, ["num_nextn_predict_layers=1000000000000 exceeds num_hidden_layers=6"]),
        ({"moe_intermediate_size": 0}, ["moe_intermediate_size is missing for a MoE model"]),
        ({"n_group": 3}, ["n_group=3 does not divide n_routed_experts=8"]),
        ({"n_group": 4, "topk_group": 5}, ["topk_group=5 must lie in [1, n_group=4]"]),
        ({"num_experts_per_tok": 9}, ["num_experts_per_tok=9 exceeds"]),
        # issue 38: a group of one expert used to fail at the first forward (noaux_tc scores a group by its top two)
        ({"n_group": 8, "topk_group": 2}, ["n_group=8 leaves one expert per group of n_routed_experts=8", "at least 2"]),
    ],
)
def test_bad_field_is_one_line_naming_file_field_value_and_expectation(change, needles):
    refused(change, *needles)


def test_long_values_are_cut_in_the_message():
    message = refused({"eos_token_id": {"x": "y" * 1000}}, "eos_token_id is {")
    assert len(message) < 250 and "..." in message


def test_json_nan_in_config_file_is_refused(tmp_path):
    """json reads NaN / Infinity literals: they must not pass as numbers."""
    from deepinfer.model.loader import load_config

    (tmp_path / "config.json").write_text(json.dumps(BASE)[:-1] + ', "rms_norm_eps": NaN}')
    with pytest.raises(CheckpointError, match="rms_norm_eps is NaN"):
        load_config(tmp_path)


def test_nulls_take_the_defaults_and_good_values_pass():
    c = ModelConfig.from_dict({**BASE, "rms_norm_eps": None, "n_routed_experts": 0, "rope_scaling": None, "quantization_config": {}, "eos_token_id": [1, 2]})
    assert c.rms_norm_eps == 1e-6 and c.n_routed_experts is None and c.rope_scaling is None and c.quantization is None
    assert c.eos_token_ids == (1, 2)
    c = ModelConfig.from_dict({**BASE, "rope_scaling": YARN, "rms_norm_eps": 1, "routed_scaling_factor": 2})
    assert c.rope_scaling["factor"] == 40.0 and c.rms_norm_eps == 1.0 and isinstance(c.routed_scaling_factor, float)


def test_the_field_table_declares_each_field_once_with_a_kind():
    names = [f.name for f in CONFIG_FIELDS]
    assert len(names) == len(set(names))
    assert {"hidden_size", "max_position_embeddings", "rms_norm_eps", "eos_token_id", "n_routed_experts"} <= set(names)


def test_transformers_written_configs_pass(v3_checkpoint, v2_checkpoint):
    from deepinfer.model.loader import load_config

    for folder, _ in (v3_checkpoint, v2_checkpoint):
        config = load_config(folder)
        assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn"
