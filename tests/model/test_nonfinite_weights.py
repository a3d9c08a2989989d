"""Loaded weights are checked for NaN / Inf (issue 13, item 12): a checkpoint with them used to load
and then emit token 0 for ever."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.model.errors import CheckpointError
from deepinfer.model.loader import load_model
from deepinfer.ops import quant


def _refused(folder, ops, dtype=torch.float32) -> str:
    with pytest.raises(CheckpointError) as info:
        load_model(str(folder), ops, "cpu", dtype)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["model.layers.1.mlp.experts.3.down_proj.weight", "model.norm.weight", "model.layers.2.mlp.gate.e_score_correction_bias"])
def test_nan_or_inf_weight_is_refused_with_its_name_and_file(v3_copy, ops, name, value):
    folder, tensors = v3_copy
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[-1] = value
    save_file(tensors, str(folder / "model.safetensors"))
    message = _refused(folder, ops)
    assert f"{folder / 'model.safetensors'}: tensor {name} holds NaN or Inf values" in message


def test_nan_in_a_bf16_checkpoint_loaded_as_float32(v3_copy, ops):
    folder, tensors = v3_copy
    tensors = {k: v.to(torch.bfloat16) if v.dtype == torch.float32 else v for k, v in tensors.items()}
    tensors["lm_head.weight"][5, 5] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"))
    assert "tensor lm_head.weight holds NaN or Inf" in _refused(folder, ops)


def test_values_that_overflow_float16_name_the_dtype(v3_copy, ops):
    folder, tensors = v3_copy
    tensors["model.embed_tokens.weight"][0, 0] = 1e6  # finite in float32, inf in float16
    save_file(tensors, str(folder / "model.safetensors"))
    message = _refused(folder, ops, dtype=torch.float16)
    assert "tensor model.embed_tokens.weight overflows torch.float16" in message and "bfloat16 or float32" in message


def test_fp8_nan_is_found_on_its_bits(v3_copy, ops):
    """e4m3fn has NaN (S.1111.111) and no Inf; the check reads the bits, no upcast."""
    folder, tensors = v3_copy
    name = "model.layers.0.self_attn.o_proj.weight"
    weight, scale = quant.quantize_weight_fp8_block(tensors[name])
    weight.view(torch.uint8)[1, 2] = 0xFF  # -NaN
    tensors[name], tensors[f"{name}_scale_inv"] = weight, scale
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    assert f"tensor {name} holds NaN or Inf" in _refused(folder, ops)
    weight.view(torch.uint8)[1, 2] = 0x7E  # 448, the largest finite value: fine
    save_file(tensors, str(folder / "model.safetensors"))
    assert load_model(str(folder), ops, "cpu", torch.float32).model.layers[0].attn.o_proj.weight.dtype == torch.float8_e4m3fn
