"""Reading an HF checkpoint folder's safetensors: find the files, check every tensor, load them.

Headers are read and checked before any tensor data is touched, so a bad checkpoint fails in a
second with a one-line message naming the tensor or file, never half-way through a long load.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open

from deepinfer.model.config import ModelConfig, ceil_div
from deepinfer.model.errors import CheckpointError
from deepinfer.model.folder import folder_file, open_regular, read_json_object, regular_file
from deepinfer.model.schema import shown
from deepinfer.model.weights import FLOAT32, LINEAR, SCALE_SUFFIX, TensorSpec

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = {"BF16", "F16", "F32", "F64"}
FP8_DTYPE = "F8_E4M3"
FP8_BLOCK = 128
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exporters save; recomputed here
MAX_HEADER = 100 * 1024 * 1024
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: str  # safetensors dtype name: BF16, F32, F8_E4M3, ...
    shape: tuple[int, ...]
    offset: int  # start of its data in the file, to read files in order


def read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors a .safetensors file declares; CheckpointError if the file is truncated or corrupt."""
    refetch = "re-download or re-export it"
    with open_regular(file) as f:
        try:
            size = os.fstat(f.fileno()).st_size
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{file}: not a safetensors file (only {size} bytes)", refetch)
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(MAX_HEADER, size - 8):
                raise CheckpointError(f"{file}: corrupt or truncated safetensors header ({header_len} header bytes, file has {size})", refetch)
            header = json.loads(f.read(header_len))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise CheckpointError(f"{file}: cannot read the safetensors header ({reason})", refetch) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header", refetch)
    tensors, data_end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            dtype, shape = entry["dtype"], tuple(entry["shape"])
            if not (isinstance(dtype, str) and all(_is_size(d) for d in shape) and _is_size(begin) and _is_size(end) and begin <= end):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: corrupt safetensors header entry for {name!r}", refetch) from None
        tensors[name] = StoredTensor(file, dtype, shape, 8 + header_len + begin)
        data_end = max(data_end, end)
    if 8 + header_len + data_end > size:
        raise CheckpointError(
            f"{file}: truncated: {size} bytes but its header needs {8 + header_len + data_end}",
            "the download or copy was interrupted, fetch the file again",
        )
    return tensors


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def find_tensors(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint by name: from the shard index, the single file, or all .safetensors files.

    Every file is checked (inside the folder, a regular file: see folder.py) before any is opened.
    """
    index = folder_file(folder, INDEX_FILE)
    if index is not None:
        weight_map = read_weight_map(index)
        shards: dict[str, Path] = {}
        for name, shard in weight_map.items():
            if shard not in shards:
                path = folder_file(folder, shard, named_by=f"{index}: weight_map entry {name!r}")
                if path is None:
                    raise CheckpointError(f"{index} names shard {shard}, which is missing from {folder}", "download it")
                shards[shard] = path
        headers = {shard: read_header(path) for shard, path in sorted(shards.items())}
        tensors = {}
        for name, shard in weight_map.items():
            if name not in headers[shard]:
                raise CheckpointError(f"{index} maps tensor {name} to {shard}, which does not hold it", "the index and shards disagree, re-download them")
            tensors[name] = headers[shard][name]
        return tensors
    single = folder_file(folder, SINGLE_FILE)
    names = [SINGLE_FILE] if single is not None else sorted(p.name for p in folder.glob("*.safetensors"))
    files = [folder_file(folder, name) for name in names]
    files = [f for f in files if f is not None]  # a dangling link inside the folder: as if absent
    if not files:
        pickles = sorted(p.name for pattern in PICKLE_PATTERNS for p in folder.glob(pattern))
        if pickles:
            raise CheckpointError(
                f"{folder} holds only pickle weights ({', '.join(pickles[:3])}{', ...' if len(pickles) > 3 else ''}), which are refused "
                "(unpickling can run arbitrary code)",
                "convert them to safetensors, e.g. transformers' save_pretrained(..., safe_serialization=True)",
            )
        raise CheckpointError(f"{folder} has no {SINGLE_FILE} (nor {INDEX_FILE})", "point --model at an HF checkpoint folder")
    tensors = {}
    for file in files:
        for name, stored in read_header(file).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name} is in both {tensors[name].file.name} and {file.name}", "remove the duplicate file")
            tensors[name] = stored
    return tensors


def read_weight_map(index: Path) -> dict[str, str]:
    """The index's `weight_map` (tensor name -> shard file name), checked for its types."""
    data = read_json_object(index)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index}: weight_map is {shown(weight_map)}, expected an object mapping tensor names to shard files", "fix or re-download the index"
        )
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(
                f"{index}: weight_map entry {name!r} is {shown(shard)}, expected a shard file name (a string)", "fix or re-download the index"
            )
    return weight_map


def check_tensors(
    stored: dict[str, StoredTensor],
    specs: dict[str, TensorSpec],
    config: ModelConfig,
    folder: Path,
    extra_prefixes: Iterable[str] = (),
) -> None:
    """Names, shapes and dtypes against the model's specs: one CheckpointError for the first problem found."""
    extra_prefixes = tuple(extra_prefixes)
    for name, spec in specs.items():
        if name not in stored:
            raise CheckpointError(f"{folder}: tensor {name} (shape {list(spec.shape)}) is missing", "the checkpoint does not match its config.json")
        tensor = stored[name]
        if tensor.shape != spec.shape:
            raise CheckpointError(
                f"{tensor.file}: tensor {name} has shape {list(tensor.shape)}, config.json implies {list(spec.shape)}",
                "the checkpoint and its config.json disagree",
            )
        _check_dtype(name, tensor, spec, stored, config)
    scales = {f"{n}{SCALE_SUFFIX}" for n, s in specs.items() if s.kind == LINEAR and stored[n].dtype == FP8_DTYPE}
    for name, tensor in stored.items():
        if name in specs or name in scales or name.startswith(extra_prefixes) or name.endswith(IGNORED_SUFFIXES):
            continue
        raise CheckpointError(f"{tensor.file}: unexpected tensor {name}", f"the checkpoint does not match its config.json ({config.model_type})")


def _check_dtype(name: str, tensor: StoredTensor, spec: TensorSpec, stored: dict[str, StoredTensor], config: ModelConfig) -> None:
    if tensor.dtype in FLOAT_DTYPES:
        return
    if tensor.dtype != FP8_DTYPE or spec.kind != LINEAR:
        raise CheckpointError(f"{tensor.file}: tensor {name} has dtype {tensor.dtype}", "only BF16/F16/F32/F64 (and F8_E4M3 for projections) load")
    if config.quantization is None:
        raise CheckpointError(f"{tensor.file}: tensor {name} is F8_E4M3 but config.json has no fp8 quantization_config", "add one or re-export the checkpoint")
    scale_name = f"{name}{SCALE_SUFFIX}"
    scale = stored.get(scale_name)
    want = (ceil_div(spec.shape[0], FP8_BLOCK), ceil_div(spec.shape[1], FP8_BLOCK))
    if scale is None:
        raise CheckpointError(f"{tensor.file}: tensor {scale_name} (shape {list(want)}) is missing for the FP8 weight {name}", "re-export the checkpoint")
    if scale.shape != want or scale.dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"{scale.file}: tensor {scale_name} is {scale.dtype} {list(scale.shape)}, expected a float scale of shape {list(want)}", "re-export the checkpoint"
        )


def kept_dtype(name: str, tensor: StoredTensor, specs: dict[str, TensorSpec], dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a tensor is kept in: None keeps FP8 as stored; scales and router tensors are float32."""
    if tensor.dtype == FP8_DTYPE:
        return None
    spec = specs.get(name)
    if name.endswith(SCALE_SUFFIX) or (spec is not None and spec.kind == FLOAT32):
        return torch.float32
    if spec is None and (name.endswith("e_score_correction_bias") or name.endswith("mlp.gate.weight")):
        return torch.float32  # MTP layers' routers, kept like the main model's
    return dtype


def load_tensors(
    stored: dict[str, StoredTensor],
    specs: dict[str, TensorSpec],
    device: torch.device,
    dtype: torch.dtype,
    skip: Iterable[str] = (),
) -> dict[str, torch.Tensor]:
    """Read every tensor (file by file, in file order) into its kept dtype on `device`, with a progress bar.

    Each tensor is checked for NaN/Inf as it arrives (`check_finite`): a checkpoint with them would
    otherwise run and emit garbage (token 0 for ever).
    """
    from tqdm import tqdm

    skip = set(skip)
    wanted = sorted((t.file, t.offset, n) for n, t in stored.items() if n not in skip and not n.endswith(IGNORED_SUFFIXES))
    out: dict[str, torch.Tensor] = {}
    bar = tqdm(total=len(wanted), desc="Loading weights", unit="tensor", file=sys.stderr, disable=not sys.stderr.isatty(), leave=False)
    current, handle = None, None
    try:
        for file, _, name in wanted:
            if file != current:
                handle = open_safetensors(file)
                current = file
            try:
                tensor = handle.get_tensor(name)
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{file}: cannot read tensor {name} ({exc})", "the file is corrupt, fetch it again") from None
            target = kept_dtype(name, stored[name], specs, dtype)
            kept = tensor.to(device=device, dtype=target) if target is not None else tensor.to(device=device)
            check_finite(kept, name, file, stored=tensor)
            out[name] = kept
            bar.update(1)
    finally:
        bar.close()
    return out


FP8_NAN_BITS = 0x7F  # float8_e4m3fn: S.1111.111 is NaN (it has no Inf)


def check_finite(tensor: torch.Tensor, name: str, file: Path, stored: torch.Tensor | None = None) -> None:
    """CheckpointError if `tensor` holds NaN or Inf: one reduction (one host sync) per tensor, on
    its device. FP8 is checked on its bits (no upcast). `stored`: the tensor as read, to tell a
    checkpoint's own NaN/Inf from values the cast to a narrower dtype overflowed."""
    if tensor.dtype == torch.float8_e4m3fn:
        bad = bool(((tensor.view(torch.uint8) & FP8_NAN_BITS) == FP8_NAN_BITS).any())
    elif tensor.is_floating_point():
        bad = not bool(torch.isfinite(tensor).all())
    else:
        return
    if not bad:
        return
    cast_from_float = stored is not None and stored.dtype != tensor.dtype and stored.is_floating_point() and stored.dtype != torch.float8_e4m3fn
    if cast_from_float and bool(torch.isfinite(stored).all()):
        raise CheckpointError(
            f"{file}: tensor {name} overflows {tensor.dtype} (its {stored.dtype} values exceed that dtype's range)",
            "load it in bfloat16 or float32 (--dtype)",
        )
    raise CheckpointError(
        f"{file}: tensor {name} holds NaN or Inf values", "the checkpoint is broken (a failed training run or export); re-download or re-export it"
    )


def read_in_file_order(wanted) -> dict[str, torch.Tensor]:
    """Tensors by name from (file, offset, name, name in the file) entries, read in that sorted order (file by
    file, each front to back: one open per file, sequential reads); an unreadable one is a one-line CheckpointError."""
    raw: dict[str, torch.Tensor] = {}
    current = handle = None
    for file, _, name, source in sorted(wanted):
        if file != current:
            handle, current = open_safetensors(file), file
        try:
            raw[name] = handle.get_tensor(source)
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{file}: cannot read tensor {name} ({exc})", "the file is corrupt, fetch it again") from None
    return raw


def open_safetensors(file: Path):
    regular_file(file)  # checked when found; again right before safetensors opens it by path
    try:
        return safe_open(os.fspath(file), framework="pt", device="cpu")
    except Exception as exc:
        raise CheckpointError(f"{file}: cannot open the safetensors file ({exc})", "the file is corrupt, fetch it again") from None
