"""`load_model`: an HF checkpoint folder (or, with no path, the embedded default) -> a ready model."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.model.checkpoint import check_tensors, find_tensors, load_tensors
from deepinfer.model.config import ModelConfig
from deepinfer.model.deepseek import DeepseekForCausalLM
from deepinfer.model.errors import LoadError
from deepinfer.model.linear import LinearWeight
from deepinfer.model.moe import EXPERT_PROJECTIONS, ExpertSharding, expert_tensor_prefix
from deepinfer.model.tokenizer import Tokenizer
from deepinfer.model.weights import WeightStore

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


@dataclass
class LoadedModel:
    model: DeepseekForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None  # None when the checkpoint has no tokenizer.json (token-id prompts only)
    path: str
    dummy_weights: bool = False  # True for the embedded default: random weights, meaningless text


def load_config(folder: str | Path) -> ModelConfig:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise LoadError(f"{folder} has no {CONFIG_FILE}; point --model at an HF checkpoint folder")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoadError(f"{path}: not valid JSON ({exc}); fix or re-download it") from None
    if not isinstance(raw, dict):
        raise LoadError(f"{path}: expected a JSON object")
    return ModelConfig.from_dict(raw, source=str(path))


class CheckpointExperts:
    """Reads single experts from the checkpoint again (an `ExpertSource`): what a rank needs when a
    new expert placement gives it experts it did not load. Costs no memory while unused (no host
    copy of the logical weights is kept); a read opens the safetensors file and takes one
    expert's tensors."""

    def __init__(self, stored, specs, device: torch.device, dtype: torch.dtype):
        self.stored, self.specs, self.device, self.dtype = stored, specs, device, dtype

    def __call__(self, layer_prefix: str, expert: int) -> tuple[LinearWeight, ...]:
        names = {}
        for proj in EXPERT_PROJECTIONS:
            base = expert_tensor_prefix(layer_prefix, expert, proj)
            for name in (f"{base}.weight", f"{base}.weight_scale_inv"):
                if name in self.stored:
                    names[name] = self.stored[name]
        weights = WeightStore(load_tensors(names, self.specs, self.device, self.dtype))
        return tuple(weights.linear(expert_tensor_prefix(layer_prefix, expert, p)) for p in EXPERT_PROJECTIONS)


def load_model(
    path: str | None,
    ops,
    device: torch.device | str,
    dtype: torch.dtype,
    experts: ExpertSharding | None = None,
) -> LoadedModel:
    """Load the checkpoint folder `path` (None: the embedded tiny DeepSeek-V3 with dummy weights).

    FP8 block-scaled weights stay FP8; every other floating weight is cast to `dtype`. Raises
    LoadError (one line naming the file or tensor) for anything that does not fit. `experts`:
    expert parallelism / redundant experts; this rank then loads only the experts it holds.
    """
    dummy = path is None
    if dummy:
        from deepinfer.model.embedded import ensure_embedded

        folder = ensure_embedded()
    else:
        folder = Path(path).expanduser()
        if not folder.exists():
            raise LoadError(f"model path {path} does not exist; pass an HF checkpoint folder")
        if not folder.is_dir():
            raise LoadError(f"model path {path} is a file; pass the checkpoint folder that holds it")
    if not dtype.is_floating_point:
        raise LoadError(f"dtype {dtype} is not a floating dtype; use bfloat16, float16 or float32")
    config = load_config(folder)
    placement = None
    if experts is not None:
        try:
            placement = experts.placement(config)
        except ValueError as exc:
            raise LoadError(str(exc)) from None
    model = DeepseekForCausalLM(config, ops, device, dtype, placement=placement)
    specs = model.tensor_specs()
    stored = find_tensors(folder)
    check_tensors(stored, specs, config, folder, extra_prefixes=model.mtp_prefixes())
    skip = model.skipped_expert_tensors(stored)  # experts other ranks hold
    weights = WeightStore(load_tensors(stored, specs, model.device, dtype, skip=skip))
    model.load_weights(weights)
    if placement is not None:
        model.expert_source = CheckpointExperts(stored, specs, model.device, dtype)
    if weights.remaining():  # check_tensors lets nothing else through; a leftover is a bug here
        raise RuntimeError(f"tensors loaded but not used by the model: {weights.remaining()[:5]}")
    tokenizer = Tokenizer.from_folder(folder, config.bos_token_id, config.eos_token_ids)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        log.warning("%s: the tokenizer has %d tokens, the model's vocab_size is %d", folder, tokenizer.vocab_size, config.vocab_size)
    dummy = dummy or bool(config.raw.get("deepinfer_dummy_weights"))
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, path=str(folder), dummy_weights=dummy)
