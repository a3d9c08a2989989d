"""Loading a DeepSeek-V4 checkpoint folder into a ready `DeepseekV4ForCausalLM`."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from deepinfer.model.checkpoint import find_tensors
from deepinfer.model.deepseek_v4.checkpoint import canonical_tensors, check_v4_tensors, load_v4_tensors
from deepinfer.model.deepseek_v4.config import V4Config
from deepinfer.model.deepseek_v4.model import DeepseekV4ForCausalLM, model_tensor_specs
from deepinfer.model.deepseek_v4.mtp import mtp_kinds, mtp_prefixes, mtp_tensor_specs
from deepinfer.model.errors import CheckpointError, LoadError
from deepinfer.model.memory import TENSOR_BOOKKEEPING, MemoryEstimate, check_fits


def estimate_v4_memory(specs, stored, dtype: torch.dtype, rope_positions: int, rope_dim: int) -> MemoryEstimate:
    """Device bytes of the weights as kept (stored FP8 / FP4 stay so; floats take `dtype`), the two
    RoPE tables and their inverses; host bytes of building them and of the tensor bookkeeping."""
    size = torch.empty((), dtype=dtype).element_size()
    weights = 0
    for name, tensor in stored.items():
        numel = math.prod(tensor.shape)
        if tensor.dtype in ("F8_E4M3", "F8_E8M0", "U8", "I8"):
            weights += numel  # kept as stored
        elif tensor.dtype == "I64" or (name in specs and specs[name].kind == "float32"):
            weights += numel * (8 if tensor.dtype == "I64" else 4)
        else:
            weights += numel * size
    rope = 4 * rope_positions * rope_dim * 4
    return MemoryEstimate(weights, rope, 0, 5 * rope, TENSOR_BOOKKEEPING * len(stored), rope_positions, len(stored))


def load_v4(folder: Path, config: V4Config, ops, device: torch.device, dtype: torch.dtype, max_model_len: int | None, experts) -> DeepseekV4ForCausalLM:
    if experts is not None:
        raise LoadError("expert parallelism (--ep, redundant experts) is not implemented for DeepSeek-V4 yet", "run it with --ep 1")
    rope_positions = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    stored, source = canonical_tensors(find_tensors(folder))
    # Sizes come from config.json: a config that implies far more tensors than the files hold is
    # refused before its specs are built (2**24 experts would take minutes and gigabytes to list).
    implied = config.num_hidden_layers * (3 * config.n_routed_experts + 40)
    if implied > 2 * len(stored) + 4096:
        problem = f"{folder / 'config.json'} implies about {implied} tensors, the checkpoint holds {len(stored)}"
        raise CheckpointError(problem, "the checkpoint does not match its config.json")
    specs = model_tensor_specs(config)
    mtp_blocks = {}  # the MTP blocks the checkpoint ships whole (speculative decoding's drafter): index -> types
    for index, prefix in enumerate(mtp_prefixes(config)):
        if any(name.startswith(prefix) for name in stored):
            block = mtp_tensor_specs(config, kinds := mtp_kinds(stored, index), index)
            if all(name in stored for name in block):
                specs.update(block)
                mtp_blocks[index] = kinds
    check_fits(estimate_v4_memory(specs, stored, dtype, rope_positions, config.qk_rope_head_dim), device, config, str(folder / "config.json"))
    model = DeepseekV4ForCausalLM(config, ops, device, dtype, max_positions=rope_positions)  # the RoPE tables: after the memory check
    scales = check_v4_tensors(stored, specs, folder, tuple(mtp_prefixes(config)))
    weights = load_v4_tensors(stored, source, specs, scales, model.device, dtype, config.n_routed_experts)
    model.load_weights(weights, mtp_blocks)
    if weights.remaining():  # check_v4_tensors lets nothing else through; a leftover is a bug here
        raise RuntimeError(f"tensors loaded but not used by the model: {weights.remaining()[:5]}")
    return model
