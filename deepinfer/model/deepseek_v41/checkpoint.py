"""Checking and reading a DeepSeek-V4.1 checkpoint's tensors in the formats its release ships.

Formats per storage kind (tensors.py), each also accepted as a plain float (BF16 / F16 / F32):
- FP8_BLOCK: `float8_e4m3fn` weight + `<base>.scale` e8m0 (F8_E8M0 or U8 bytes) per 32x32 block, [ceil(N/32), ceil(K/32)];
- FP4_EXPERT: e2m1 packed two per byte (low nibble = even column), I8 or U8 [N, K/2], + `.scale` e8m0 [N, K/32];
- FP8_ROWS (Engram tables): `float8_e4m3fn` rows [R, D] + `.scale` e8m0 [R, ceil(D/32)];
- FLOAT / FLOAT32: floats only.
Quantised tensors are kept as stored (`QuantizedTensor`: the FP8 or packed bytes and the raw e8m0
bytes), never dequantised here. The vision tower's tensors are recognised and skipped (text only).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.model.checkpoint import FLOAT_DTYPES, IGNORED_SUFFIXES, StoredTensor, check_finite, read_in_file_order
from deepinfer.model.config import ceil_div
from deepinfer.model.deepseek_v4.checkpoint import E8M0, FP8, PACKED_FP4, check_e8m0
from deepinfer.model.deepseek_v41.config import WEIGHT_BLOCK
from deepinfer.model.deepseek_v41.tensors import FLOAT32, FP4_EXPERT, FP8_BLOCK, FP8_ROWS, VISION_PREFIXES, V41TensorSpec
from deepinfer.model.errors import CheckpointError

log = logging.getLogger(__name__)

_ACCEPTED = {
    FP8_BLOCK: "F8_E4M3 (with an e8m0 .scale per 32x32 block) or BF16/F16/F32",
    FP4_EXPERT: "packed FP4 in I8/U8 (with an e8m0 .scale per 32 columns) or BF16/F16/F32",
    FP8_ROWS: "F8_E4M3 rows (with an e8m0 .scale per 32 columns) or BF16/F16/F32",
}
_FIX = "the checkpoint does not match its config.json (deepseek_v41)"


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight kept in its stored format: `data` float8_e4m3fn [N, K] or uint8 packed e2m1 [N, K/2];
    `scale` the raw e8m0 bytes (uint8; 2 ** (byte - 127)), one per `block` (rows, columns) of `data`'s logical [N, K]."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str  # FP8_BLOCK, FP4_EXPERT or FP8_ROWS
    block: tuple[int, int]


def _scale_layout(spec: V41TensorSpec, stored: StoredTensor, name: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """(the `.scale` shape the weight implies, the block each scale covers)."""
    rows, cols = spec.shape
    if spec.kind == FP8_BLOCK:
        return (ceil_div(rows, WEIGHT_BLOCK), ceil_div(cols, WEIGHT_BLOCK)), (WEIGHT_BLOCK, WEIGHT_BLOCK)
    if spec.kind == FP4_EXPERT and cols % WEIGHT_BLOCK:
        raise CheckpointError(f"{stored.file}: the FP4 expert {name} has K={cols}, not a multiple of {WEIGHT_BLOCK}", "re-export it")
    return (rows, ceil_div(cols, WEIGHT_BLOCK)), (1, WEIGHT_BLOCK)


def _quantized(spec: V41TensorSpec, tensor: StoredTensor) -> bool:
    """Whether a tensor of this kind is stored in its quantised format (else it must be a float)."""
    if spec.kind == FP4_EXPERT:
        return tensor.dtype in PACKED_FP4
    return spec.kind in (FP8_BLOCK, FP8_ROWS) and tensor.dtype == FP8


def check_v41_tensors(stored: dict[str, StoredTensor], specs: dict[str, V41TensorSpec], folder: Path) -> tuple[set[str], list[str]]:
    """Names, shapes, dtypes and scales against the specs: one CheckpointError for the first problem.
    Returns (the `.scale` tensors the quantised weights use, the vision tensors skipped)."""
    scales = set()
    for name, spec in specs.items():
        tensor = stored.get(name)
        if tensor is None:
            if spec.optional:
                continue
            raise CheckpointError(f"{folder}: tensor {name} (shape {list(spec.shape)}) is missing", _FIX)
        quantized = _quantized(spec, tensor)
        want = (spec.shape[0], spec.shape[1] // 2) if quantized and spec.kind == FP4_EXPERT else spec.shape
        if tensor.shape != want:
            raise CheckpointError(f"{tensor.file}: tensor {name} has shape {list(tensor.shape)}, config.json implies {list(want)}", _FIX)
        if not quantized:
            if tensor.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"{tensor.file}: tensor {name} has dtype {tensor.dtype}, expected {_ACCEPTED.get(spec.kind, 'BF16/F16/F32')}", _FIX)
            continue
        scale_want = _scale_layout(spec, tensor, name)[0]
        scale_name = name.removesuffix(".weight") + ".scale"
        scale = stored.get(scale_name)
        if scale is None:
            raise CheckpointError(f"{tensor.file}: tensor {scale_name} (shape {list(scale_want)}) is missing for the quantised weight {name}", _FIX)
        if scale.shape != scale_want or scale.dtype not in E8M0:
            problem = (
                f"{scale.file}: tensor {scale_name} is {scale.dtype} {list(scale.shape)}, expected an e8m0 (F8_E8M0 or U8) scale of shape {list(scale_want)}"
            )
            raise CheckpointError(problem, _FIX)
        scales.add(scale_name)
    vision = []
    for name, tensor in stored.items():
        if name in specs or name in scales or name.endswith(IGNORED_SUFFIXES):
            continue
        if name.startswith(VISION_PREFIXES):
            vision.append(name)
            continue
        raise CheckpointError(f"{tensor.file}: unexpected tensor {name}", _FIX)
    if vision:
        log.warning("%s: skipped the vision tower's %d tensors (vision.*, aligner.*, image_*): DeepSeek-V4.1 loads text-only", folder, len(vision))
    return scales, vision


def read_v41_tensors(
    stored: dict[str, StoredTensor], specs: dict[str, V41TensorSpec], scales: set[str], device: torch.device, dtype: torch.dtype,
) -> dict[str, torch.Tensor | QuantizedTensor]:  # fmt: skip
    """Every checked text tensor as kept: quantised weights as `QuantizedTensor` (FP8 and packed FP4
    stay so, with their e8m0 bytes), FLOAT32 kinds in float32, other floats in `dtype`. NaN / Inf are
    refused (`check_finite` on the FP8 bits, `check_e8m0` on the scale bytes). Call `check_v41_tensors` first."""
    raw = read_in_file_order((stored[n].file, stored[n].offset, n, n) for n in (*specs, *scales) if n in stored)
    out: dict[str, torch.Tensor | QuantizedTensor] = {}
    for name, spec in specs.items():
        if name not in raw:
            continue  # an optional tensor the checkpoint does not ship
        tensor, file = raw[name], stored[name].file
        if _quantized(spec, stored[name]):
            scale_name = name.removesuffix(".weight") + ".scale"
            scale = raw[scale_name].view(torch.uint8)
            check_e8m0(scale, scale_name, file)
            data = tensor.view(torch.uint8) if spec.kind == FP4_EXPERT else tensor  # e2m1 codes are all finite
            check_finite(data, name, file)
            out[name] = QuantizedTensor(data.to(device), scale.to(device), spec.kind, _scale_layout(spec, stored[name], name)[1])
            continue
        kept = tensor.to(device=device, dtype=torch.float32 if spec.kind == FLOAT32 else dtype)
        check_finite(kept, name, file, stored=tensor)
        out[name] = kept
    return out


__all__ = ["QuantizedTensor", "check_v41_tensors", "read_v41_tensors"]
