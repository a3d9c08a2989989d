"""Loading a DeepSeek-V4.1 checkpoint folder: config and tensors validated; the model itself is not built yet.

V4.1's forward (its layer roles, Engram, DSpark, 32x32-block FP8 GEMMs) is not built yet,
so a V4.1 folder ends here in one LoadError saying what was read and what is missing: never a
traceback, and never a fall back to V4 (whose layers would load V4.1's tensors wrongly or not at all).
Only the safetensors headers are read here: reading hundreds of gigabytes of weights only to refuse
the run would be pointless; `read_v41_tensors` reads and keeps them once the model exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

from deepinfer.model.checkpoint import find_tensors
from deepinfer.model.deepseek_v41.checkpoint import check_v41_tensors
from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.tensors import implied_tensor_count, v41_tensor_specs
from deepinfer.model.errors import CheckpointError, LoadError


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


def load_v41(folder: Path, config: V41Config) -> NoReturn:
    """Validate the folder, then refuse in one line: V4.1's forward is not implemented yet."""
    specs, scales = validate_v41_folder(folder, config)
    roles = ", ".join(f"{kind} x{sum(r.kind == kind for r in config.roles)}" for kind in dict.fromkeys(r.kind for r in config.roles))
    raise LoadError(
        f"{folder} is a DeepSeek-V4.1 checkpoint: its config.json ({config.num_hidden_layers} layers: {roles}; "
        f"{len(config.engram_layer_ids)} Engram, {config.num_nextn_predict_layers} DSpark blocks) and the headers of its "
        f"{len(specs) + len(scales)} text tensors (names, shapes, dtypes, e8m0 scales) were read and validated, "
        "but V4.1's forward (its layer roles) is not implemented yet",
        "run a DeepSeek V2/V3/V4 checkpoint meanwhile",
    )
