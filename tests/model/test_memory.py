"""The memory estimate from config.json, and refusals that come before anything is allocated
(issue 13, item 12: 2**24 experts and 10**10 positions used to eat memory for minutes)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from deepinfer.model import deepseek, memory
from deepinfer.model.config import ModelConfig
from deepinfer.model.deepseek import model_tensor_specs
from deepinfer.model.errors import LoadError
from deepinfer.model.loader import load_model
from deepinfer.model.memory import estimate_model_memory, num_moe_layers
from deepinfer.model.weights import FLOAT32

from model.test_config_schema import BASE


def _spec_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of every tensor the model keeps, from its specs (what the estimate must match)."""
    item = torch.empty((), dtype=dtype).element_size()
    total = 0
    for spec in model_tensor_specs(config).values():
        numel = 1
        for d in spec.shape:
            numel *= d
        total += numel * (4 if spec.kind == FLOAT32 else item)
    return total


@pytest.mark.parametrize(
    "change",
    [{}, {"q_lora_rank": 24}, {"tie_word_embeddings": True}, {"first_k_dense_replace": 2, "moe_layer_freq": 2},
     {"n_routed_experts": None}, {"n_shared_experts": 2}],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_estimated_weights_match_the_model_specs(change, dtype):
    config = ModelConfig.from_dict({**BASE, **change})
    estimate = estimate_model_memory(config, dtype, rope_positions=100)
    one_layer_experts = config.n_routed_experts * 3 * config.hidden_size * config.moe_intermediate_size * dtype.itemsize if num_moe_layers(config) else 0
    assert estimate.weights == _spec_bytes(config, dtype) + one_layer_experts
    assert estimate.rope_table == 100 * config.qk_rope_head_dim * 4


@pytest.mark.parametrize("layers, first, freq", [(6, 0, 1), (6, 1, 1), (6, 1, 2), (6, 3, 2), (5, 5, 1), (7, 2, 3), (1, 0, 4)])
def test_moe_layers_counted_without_walking_the_layers(layers, first, freq):
    config = ModelConfig.from_dict({**BASE, "num_hidden_layers": layers, "first_k_dense_replace": first, "moe_layer_freq": freq})
    assert num_moe_layers(config) == sum(config.is_moe_layer(i) for i in range(layers))


def test_fp8_weights_count_one_byte_and_their_scales():
    config = ModelConfig.from_dict({**BASE, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    dense = estimate_model_memory(ModelConfig.from_dict(BASE), torch.bfloat16, 1)
    fp8 = estimate_model_memory(config, torch.bfloat16, 1)
    assert fp8.weights < dense.weights


def test_experts_held_by_this_rank_only():
    config = ModelConfig.from_dict(BASE)
    every = estimate_model_memory(config, torch.float32, 1)
    half = estimate_model_memory(config, torch.float32, 1, physical_experts_held=4, physical_experts=8)
    per_expert = 3 * 64 * 32 * 4
    assert every.weights - half.weights == (num_moe_layers(config) + 1) * 4 * per_expert


@pytest.fixture
def folder(v3_checkpoint, tmp_path):
    source, _ = v3_checkpoint
    shutil.copytree(source, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _edit_config(folder, **change):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))


@pytest.fixture
def nothing_allocated(monkeypatch):
    """Fail the test if the model is built (its RoPE table, its specs) before the refusal."""

    def fail(*args, **kwargs):
        pytest.fail("the model was built before the memory check refused it")

    monkeypatch.setattr(deepseek, "rope_cos_sin_cache", fail)
    monkeypatch.setattr(deepseek, "model_tensor_specs", fail)


@pytest.mark.parametrize(
    "change, needles",
    [
        ({"max_position_embeddings": 10**10}, ["RoPE table for 10000000000 positions", "max_position_embeddings=10000000000", "TiB"]),
        ({"n_routed_experts": 2**24}, ["weights", "TiB", "check config.json's sizes"]),
        ({"hidden_size": 2**40}, ["weights"]),
    ],
)
def test_absurd_sizes_are_refused_before_anything_is_allocated(folder, ops, nothing_allocated, change, needles):
    _edit_config(folder, **change)
    with pytest.raises(LoadError) as info:
        load_model(str(folder), ops, "cpu", torch.float32)
    message = str(info.value)
    assert "\n" not in message and "loading this model needs at least" in message and "available RAM" in message
    for needle in needles:
        assert needle in message, message


def test_refusal_names_the_estimate_and_what_the_device_has(folder, ops, monkeypatch):
    monkeypatch.setattr(memory, "host_available", lambda: 1 << 20)  # 1 MiB of RAM
    with pytest.raises(LoadError) as info:
        load_model(str(folder), ops, "cpu", torch.float32)
    message = str(info.value)
    assert "needs at least" in message and "weights" in message and "but 1.0 MiB is available RAM" in message, message


def test_accelerator_memory_is_asked_from_the_device_module(monkeypatch):
    """A device whose torch module has mem_get_info (torch.cuda, torch.npu) is measured by it, and
    the host is then checked apart for the RoPE temporaries and the bookkeeping."""
    assert memory.device_available(torch.device("cpu"))[1] == "available RAM"  # torch.cpu has no mem_get_info
    monkeypatch.setattr(torch.cpu, "mem_get_info", lambda device: (1000, 10**9), raising=False)
    assert memory.device_available(torch.device("cpu")) == (1000, "free on cpu")
    config = ModelConfig.from_dict(BASE)
    with pytest.raises(LoadError, match="on cpu .*but 0.0 MiB is free on cpu"):
        memory.check_fits(estimate_model_memory(config, torch.float32, 16), torch.device("cpu"), config, "config.json")
    monkeypatch.setattr(torch.cpu, "mem_get_info", lambda device: (10**12, 10**12), raising=False)
    monkeypatch.setattr(memory, "host_available", lambda: 1000)
    with pytest.raises(LoadError, match="on the host .*RoPE table temporaries"):
        memory.check_fits(estimate_model_memory(config, torch.float32, 16), torch.device("cpu"), config, "config.json")


def test_rope_table_holds_the_engine_length_not_max_position_embeddings(folder, ops):
    _edit_config(folder, max_position_embeddings=10**9)  # a 1e9-row table would need 32 GB
    loaded = load_model(str(folder), ops, "cpu", torch.float32, max_model_len=64)
    assert loaded.model.cos_sin_cache.shape == (64, 8)
    assert loaded.model.max_positions == 64
