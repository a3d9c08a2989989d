"""Loading a DeepSeek-V4.1 checkpoint folder: config and tensor headers validated, memory checked, tensors read,
the model built.

Never a fall back to V4 (whose layers would load V4.1's tensors wrongly or not at all). The Engram token map
comes from the folder's own tokenizer.json.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from deepinfer.model.checkpoint import find_tensors
from deepinfer.model.deepseek_v41.checkpoint import check_v41_tensors, read_v41_tensors
from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.engram_tokens import compressed_token_map
from deepinfer.model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.model.deepseek_v41.tensors import FLOAT32, FP8_ROWS, implied_tensor_count, v41_tensor_specs
from deepinfer.model.deepseek_v41.weights import V41Weights
from deepinfer.model.errors import CheckpointError, LoadError
from deepinfer.model.memory import TENSOR_BOOKKEEPING, MemoryEstimate, check_fits
from deepinfer.model.tokenizer import TOKENIZER_FILE

_KEPT_AS_STORED = ("F8_E4M3", "F8_E8M0", "U8", "I8")  # FP8 projections, packed FP4 experts and their e8m0 scales


def validate_v41_folder(folder: Path, config: V41Config) -> tuple[dict, set[str]]:
    """(the tensor specs, the scale tensors) after checking every tensor header of `folder` against
    its config; one CheckpointError for the first problem."""
    stored = find_tensors(folder)
    # A config that implies far more tensors than the files hold is refused before its specs are listed
    # (as V4's loader does: 2**24 experts would take minutes and gigabytes to list).
    implied = implied_tensor_count(config)
    if implied > 2 * len(stored) + 4096:
        raise CheckpointError(
            f"{folder / 'config.json'} implies about {implied} tensors, the checkpoint holds {len(stored)}", "the checkpoint does not match its config.json"
        )
    specs = v41_tensor_specs(config)
    scales, _ = check_v41_tensors(stored, specs, folder)
    return specs, scales


def estimate_v41_memory(specs: dict, stored: dict, scales: set[str], dtype: torch.dtype, rope_positions: int, rope_dim: int) -> MemoryEstimate:
    """Device bytes of the text tensors as the model keeps them: FP8 projections (1 byte a weight, "fp8_block32")
    and packed FP4 experts as stored with their e8m0 bytes (1 each); Engram's FP8 tables decoded to `dtype` (their
    scales dropped); float tensors in `dtype` (FLOAT32 kinds and the vocabulary head in float32). The DSpark blocks are counted as read (not
    used yet, they stay on the device while the model loads). Plus the two RoPE tables and their inverses. A floor:
    the experts' stacking copy and the Engram tables' stored bytes, alive while the model is built, are left out."""
    size = torch.empty((), dtype=dtype).element_size()
    weights = 0
    for name, spec in specs.items():
        tensor = stored.get(name)
        if tensor is None:
            continue
        numel = math.prod(spec.shape)  # the logical shape: a packed FP4 expert holds numel / 2 bytes
        if name == "head.weight":
            weights += numel * 4  # the vocabulary projection runs in float32 (model.py)
        elif spec.kind == FP8_ROWS:
            weights += numel * size  # decoded at load
        elif tensor.dtype in _KEPT_AS_STORED:
            weights += math.prod(tensor.shape)
            scale = stored.get(name.removesuffix(".weight") + ".scale")
            weights += math.prod(scale.shape) if scale is not None else 0
        else:
            weights += numel * (4 if spec.kind == FLOAT32 else size)
    if "head.weight" not in specs:  # tied: a float32 copy of the embedding
        weights += math.prod(specs["embed.weight"].shape) * 4
    rope = 4 * rope_positions * rope_dim * 4
    count = len(specs) + len(scales)
    return MemoryEstimate(weights, rope, 0, 5 * rope, TENSOR_BOOKKEEPING * count, rope_positions, count)


def engram_token_map(folder: Path, config: V41Config) -> tuple[torch.Tensor | None, int]:
    """Engram's compressed token map from the folder's tokenizer.json (engram_tokens.py); (None, 0) without Engram."""
    if not config.engram_layer_ids:
        return None, 0
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder} has no {TOKENIZER_FILE}: DeepSeek-V4.1's Engram hashes token ids through the checkpoint's own tokenizer",
                              "add the checkpoint's tokenizer.json")  # fmt: skip
    from tokenizers import Tokenizer as Backend

    token_map, count = compressed_token_map(Backend.from_file(str(path)), config.vocab_size)
    if count != config.engram_compressed_vocab_size:
        raise CheckpointError(
            f"{path} normalises to {count} Engram token keys, config.json's text_config.engram_compressed_vocab_size is "
            f"{config.engram_compressed_vocab_size}: the Engram hashes depend on it", "use the tokenizer.json the checkpoint ships",
        )  # fmt: skip
    return token_map, count


def load_v41(folder: Path, config: V41Config, ops, device: torch.device, dtype: torch.dtype, max_model_len: int | None, experts,
             swa_bounded_replay: bool = True) -> DeepseekV41ForCausalLM:  # fmt: skip
    """Validate the folder, read its text tensors and build the model (the DSpark blocks kept for its drafter).
    swa_bounded_replay: the decoder SWA bounded replay at prefill (bounded_replay.py)."""
    if experts is not None:
        raise LoadError("expert parallelism (--ep, redundant experts) is not implemented for DeepSeek-V4.1 yet", "run it with --ep 1")
    specs, scales = validate_v41_folder(folder, config)
    stored = find_tensors(folder)
    rope_positions = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    estimate = estimate_v41_memory(specs, stored, scales, dtype, rope_positions, config.qk_rope_head_dim)
    check_fits(estimate, device, config, str(folder / "config.json"))
    token_map, compressed = engram_token_map(folder, config)
    model = DeepseekV41ForCausalLM(config, ops, device, dtype, max_positions=max_model_len, swa_bounded_replay=swa_bounded_replay)
    tensors = read_v41_tensors(stored, specs, scales, model.device, dtype)
    model.load_weights(V41Weights(tensors, dtype), token_map, compressed)
    return model
