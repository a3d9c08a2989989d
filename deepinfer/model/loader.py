"""`load_model`: an HF checkpoint folder (or, with no path, the embedded default) -> a ready model."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.model.checkpoint import check_tensors, find_tensors, load_tensors
from deepinfer.model.config import ModelConfig
from deepinfer.model.deepseek import DeepseekForCausalLM
from deepinfer.model.errors import CheckpointError, LoadError
from deepinfer.model.folder import folder_file, read_json_object
from deepinfer.model.linear import LinearWeight
from deepinfer.model.memory import check_fits, estimate_model_memory
from deepinfer.model.moe import EXPERT_PROJECTIONS, ExpertSharding, expert_tensor_prefix
from deepinfer.model.tokenizer import Tokenizer, check_tokenizer_folder
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
    folder = Path(folder)
    path = folder_file(folder, CONFIG_FILE)
    if path is None:
        raise CheckpointError(f"{folder} has no {CONFIG_FILE}", "point --model at an HF checkpoint folder")
    raw = read_json_object(path)
    if raw.get("model_type") == "deepseek_v4":
        from deepinfer.model.deepseek_v4.config import V4Config

        return V4Config.from_dict(raw, source=str(path))
    if raw.get("model_type") == "deepseek_v41":
        from deepinfer.model.deepseek_v41.config import V41Config

        return V41Config.from_dict(raw, source=str(path))
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
    *,
    max_model_len: int | None = None,
    tokenizer: str | Path | None = None,
    swa_bounded_replay: bool = True,
) -> LoadedModel:
    """Load the checkpoint folder `path` (None or "tiny-v3": the embedded tiny DeepSeek-V3 with dummy
    weights; "tiny-v4" / "tiny-v41": the embedded tiny DeepSeek-V4 / V4.1).

    FP8 block-scaled weights stay FP8; every other floating weight is cast to `dtype`. Raises
    LoadError (one line naming the file or tensor) for anything that does not fit, the device's
    memory included (checked from config.json before anything is allocated). `experts`: expert
    parallelism / redundant experts; this rank then loads only the experts it holds.
    `max_model_len`: the longest sequence the engine will run (None: max_position_embeddings);
    the RoPE table holds that many positions; longer than max_position_embeddings is a LoadError.
    `tokenizer`: a folder to load the tokenizer from instead of the checkpoint's (checked before
    the weights load). `swa_bounded_replay`: DeepSeek-V4.1's decoder SWA bounded replay at prefill (other
    models have no decoder-only layers and ignore it).
    """
    if not dtype.is_floating_point:
        raise LoadError(f"dtype {dtype} is not a floating dtype", "use bfloat16, float16 or float32")
    from deepinfer.model.embedded import ensure_embedded
    from deepinfer.model.embedded_names import check_model_path, resolve_model

    embedded = resolve_model(path)[1]
    folder = ensure_embedded(alias=embedded) if embedded is not None else check_model_path(path)
    tokenizer_folder = check_tokenizer_folder(tokenizer) if tokenizer is not None else None
    try:
        return _load_folder(folder, ops, torch.device(device), dtype, experts, max_model_len, dummy=embedded is not None,
                            tokenizer_folder=tokenizer_folder, swa_bounded_replay=swa_bounded_replay)  # fmt: skip
    except CheckpointError as exc:
        if embedded is not None or _is_embedded_folder(folder):
            raise CheckpointError(exc.problem, f"the embedded model is generated locally: delete {folder} and run again; it is regenerated") from None
        raise


def _is_embedded_folder(folder: Path) -> bool:
    from deepinfer.model.embedded import EMBEDDED, embedded_folder

    return any(os.path.realpath(folder) == os.path.realpath(embedded_folder(alias=a)) for a in EMBEDDED)


def _load_folder(
    folder: Path,
    ops,
    device: torch.device,
    dtype: torch.dtype,
    experts: ExpertSharding | None,
    max_model_len: int | None,
    dummy: bool,
    tokenizer_folder: Path | None = None,
    swa_bounded_replay: bool = True,
) -> LoadedModel:
    config = load_config(folder)
    if max_model_len is not None and max_model_len > config.max_position_embeddings:
        raise LoadError(
            f"max_model_len {max_model_len} is longer than the model's max_position_embeddings {config.max_position_embeddings} "
            f"({folder / CONFIG_FILE})", f"lower it, or leave it out to run at {config.max_position_embeddings}",
        )  # fmt: skip
    if config.model_type == "deepseek_v4":
        from deepinfer.model.deepseek_v4.load import load_v4

        model = load_v4(folder, config, ops, device, dtype, max_model_len, experts)
        return _loaded(model, config, folder, dummy, tokenizer_folder)
    if config.model_type == "deepseek_v41":  # its own model, never V4's
        from deepinfer.model.deepseek_v41.load import load_v41

        model = load_v41(folder, config, ops, device, dtype, max_model_len, experts, swa_bounded_replay)
        return _loaded(model, config, folder, dummy, tokenizer_folder)
    rope_positions = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    held = physical = None
    if experts is not None and config.n_routed_experts:
        physical = config.n_routed_experts + max(0, experts.num_redundant_experts)
        held = physical // experts.size
    estimate = estimate_model_memory(config, dtype, rope_positions, held, physical)
    check_fits(estimate, device, config, str(folder / CONFIG_FILE))
    placement = None
    if experts is not None:
        try:
            placement = experts.placement(config)
        except ValueError as exc:
            raise LoadError(str(exc)) from None
    model = DeepseekForCausalLM(config, ops, device, dtype, placement=placement, max_positions=rope_positions)
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
    return _loaded(model, config, folder, dummy, tokenizer_folder)


def _loaded(model, config, folder: Path, dummy: bool, tokenizer_folder: Path | None) -> LoadedModel:
    """The LoadedModel, with the tokenizer of `tokenizer_folder` (None: the checkpoint's own)."""
    if tokenizer_folder is not None:
        tokenizer = Tokenizer.from_other_folder(tokenizer_folder, config.bos_token_id, config.eos_token_ids)
    else:
        tokenizer = Tokenizer.from_folder(folder, config.bos_token_id, config.eos_token_ids)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        log.warning("%s: the tokenizer has %d tokens, the model's vocab_size is %d", tokenizer_folder or folder, tokenizer.vocab_size, config.vocab_size)
    dummy = dummy or bool(config.raw.get("deepinfer_dummy_weights"))
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, path=str(folder), dummy_weights=dummy)
