"""Loading a DeepSeek-V4.1 checkpoint folder: config and tensor headers validated, tensors read, the model built.

Never a fall back to V4 (whose layers would load V4.1's tensors wrongly or not at all). The Engram token map
comes from the folder's own tokenizer.json.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.model.checkpoint import find_tensors
from deepinfer.model.deepseek_v41.checkpoint import check_v41_tensors, read_v41_tensors
from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.engram_tokens import compressed_token_map
from deepinfer.model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.model.deepseek_v41.tensors import implied_tensor_count, v41_tensor_specs
from deepinfer.model.deepseek_v41.weights import V41Weights
from deepinfer.model.errors import CheckpointError, LoadError
from deepinfer.model.tokenizer import TOKENIZER_FILE


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
    """Validate the folder, read its text tensors and build the model (DSpark blocks are read, not used yet).
    swa_bounded_replay: the decoder SWA bounded replay at prefill (bounded_replay.py)."""
    if experts is not None:
        raise LoadError("expert parallelism (--ep, redundant experts) is not implemented for DeepSeek-V4.1 yet", "run it with --ep 1")
    specs, scales = validate_v41_folder(folder, config)
    token_map, compressed = engram_token_map(folder, config)
    model = DeepseekV41ForCausalLM(config, ops, device, dtype, max_positions=max_model_len, swa_bounded_replay=swa_bounded_replay)
    tensors = read_v41_tensors(find_tensors(folder), specs, scales, model.device, dtype)
    model.load_weights(V41Weights(tensors, dtype), token_map, compressed)
    return model
