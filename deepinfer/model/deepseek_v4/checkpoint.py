"""Reading a DeepSeek-V4 checkpoint: DeepSeek's tensor names, and the formats its release ships.

Names: DeepSeek's own (`layers.N.attn.wq_a.weight`, `embed.weight`, `head.weight`, `hc_head_fn`,
`mtp.N.*`); transformers' `save_pretrained` writes the same under `model.` with `embed_tokens` and
`hc_head.hc_fn`, and both are read (`canonical_name`).

Formats, per projection: bf16/fp16/fp32 (cast to the model dtype); FP8 e4m3 with a scale per
128x128 block, either `<name>.scale` in e8m0 (DeepSeek's release) or `<name>.weight_scale_inv` in
float32 (V3-style), kept FP8 with a float32 scale ("fp8_block"); routed experts also MXFP4: e2m1
packed two per byte (low nibble = even column; int8 or uint8 [N, K/2]) with `<name>.scale` e8m0
per 32 columns ([N, K/32]), kept packed ("mxfp4").
"""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.model.checkpoint import FLOAT_DTYPES, IGNORED_SUFFIXES, StoredTensor, check_finite, read_in_file_order
from deepinfer.model.config import ceil_div
from deepinfer.model.deepseek_v4.moe import EXPERT, INDEX
from deepinfer.model.errors import CheckpointError
from deepinfer.model.linear import LinearWeight
from deepinfer.model.weights import FLOAT32, LINEAR, TensorSpec, WeightStore
from deepinfer.ops.quant import MX_BLOCK

FP8 = "F8_E4M3"
E8M0 = ("F8_E8M0", "U8")  # an e8m0 scale: 2 ** (byte - 127)
PACKED_FP4 = ("I8", "U8")
INDEX_DTYPES = ("I64", "I32")
_RENAMES = (("embed_tokens.", "embed."), ("hc_head.hc_fn", "hc_head_fn"), ("hc_head.hc_base", "hc_head_base"), ("hc_head.hc_scale", "hc_head_scale"))


def canonical_name(name: str) -> str:
    """DeepSeek's name for a tensor stored under DeepSeek's or transformers' name."""
    name = name.removeprefix("model.")
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def canonical_tensors(stored: dict[str, StoredTensor]) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """The stored tensors under DeepSeek's names, and each one's name in the files."""
    by_name, source = {}, {}
    for name, tensor in stored.items():
        canonical = canonical_name(name)
        if canonical in by_name:
            raise CheckpointError(f"{tensor.file}: tensors {source[canonical]} and {name} are the same weight under two names", "keep one of them")
        by_name[canonical], source[canonical] = tensor, name
    return by_name, source


class V4Weights(WeightStore):
    """Loaded tensors by DeepSeek's name; projections are already LinearWeight (any format)."""

    def linear(self, prefix: str) -> LinearWeight:
        weight = self._tensors.pop(f"{prefix}.weight")
        return weight if isinstance(weight, LinearWeight) else LinearWeight(weight)


def _scale_name(stored: dict[str, StoredTensor], weight: str) -> str | None:
    base = weight.removesuffix(".weight")
    return next((n for n in (f"{base}.scale", f"{weight}_scale_inv") if n in stored), None)


def check_v4_tensors(stored: dict[str, StoredTensor], specs: dict[str, TensorSpec], folder: Path, extra_prefixes: tuple[str, ...]) -> set[str]:
    """Names, shapes, dtypes and scales against the specs (names already canonical): one
    CheckpointError for the first problem. Returns the scale tensors the weights use."""
    scales = set()
    for name, spec in specs.items():
        tensor = stored.get(name)
        if tensor is None:
            raise CheckpointError(f"{folder}: tensor {name} (shape {list(spec.shape)}) is missing", "the checkpoint does not match its config.json")
        packed = spec.kind == EXPERT and tensor.dtype in PACKED_FP4
        want = (spec.shape[0], spec.shape[1] // 2) if packed else spec.shape
        if tensor.shape != want:
            raise CheckpointError(
                f"{tensor.file}: tensor {name} has shape {list(tensor.shape)}, config.json implies {list(want)}", "the checkpoint and its config.json disagree"
            )
        if spec.kind == INDEX:
            if tensor.dtype not in INDEX_DTYPES:
                raise CheckpointError(f"{tensor.file}: tensor {name} has dtype {tensor.dtype}, expected an integer table (I64/I32)", "re-export the checkpoint")
            continue
        if tensor.dtype in FLOAT_DTYPES:
            continue
        quantizable = spec.kind in (LINEAR, EXPERT)
        if not quantizable or not (tensor.dtype == FP8 or packed):
            fix = "only BF16/F16/F32 (F8_E4M3 projections, packed FP4 experts) load"
            raise CheckpointError(f"{tensor.file}: tensor {name} has dtype {tensor.dtype}", fix)
        scale_name = _scale_name(stored, name)
        if packed:
            if spec.shape[1] % MX_BLOCK:
                    raise CheckpointError(f"{tensor.file}: the FP4 expert {name} has K={spec.shape[1]}, not a multiple of {MX_BLOCK}", "re-export it")
            scale_want, scale_dtypes, kind = (spec.shape[0], spec.shape[1] // MX_BLOCK), E8M0, "an e8m0 (F8_E8M0 or U8) MXFP4 scale"
        else:
            scale_want = (ceil_div(spec.shape[0], 128), ceil_div(spec.shape[1], 128))
            scale_dtypes, kind = (*E8M0, *FLOAT_DTYPES), "an e8m0 or float FP8 block scale"
        if scale_name is None:
            base = name.removesuffix(".weight")
            problem = f"{tensor.file}: tensor {base}.scale (shape {list(scale_want)}) is missing for the quantised weight {name}"
            raise CheckpointError(problem, "re-export the checkpoint")
        scale = stored[scale_name]
        if scale.shape != scale_want or scale.dtype not in scale_dtypes:
            problem = f"{scale.file}: tensor {scale_name} is {scale.dtype} {list(scale.shape)}, expected {kind} of shape {list(scale_want)}"
            raise CheckpointError(problem, "re-export the checkpoint")
        scales.add(scale_name)
    for name, tensor in stored.items():
        if name in specs or name in scales or name.startswith(extra_prefixes) or name.endswith(IGNORED_SUFFIXES):
            continue
        raise CheckpointError(f"{tensor.file}: unexpected tensor {name}", "the checkpoint does not match its config.json (deepseek_v4)")
    return scales


E8M0_NAN = 0xFF  # e8m0 has no Inf and one NaN


def _e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    exponent = scale.view(torch.uint8).to(torch.int32) - 127
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)


def check_e8m0(scale: torch.Tensor, name: str, file: Path) -> None:
    """CheckpointError if an e8m0 scale holds its NaN (0xFF): every value it scales would be NaN."""
    if bool((scale.view(torch.uint8) == E8M0_NAN).any()):
        raise CheckpointError(
            f"{file}: tensor {name} holds NaN or Inf values (e8m0 scale bytes 0xFF)",
            "the checkpoint is broken (a failed training run or export); re-download or re-export it",
        )


def check_expert_ids(table: torch.Tensor, name: str, file: Path, num_experts: int) -> None:
    """CheckpointError unless every id of a hash-routing table (tid2eid) names an expert in [0, num_experts)."""
    bad = (table < 0) | (table >= num_experts)
    if bool(bad.any()):
        value = int(table[bad][0])
        raise CheckpointError(
            f"{file}: tensor {name} holds expert id {value}, outside [0, n_routed_experts={num_experts})", "the checkpoint does not match its config.json"
        )


def load_v4_tensors(
    stored: dict[str, StoredTensor], source: dict[str, str], specs: dict[str, TensorSpec], scales: set[str], device: torch.device, dtype: torch.dtype,
    num_experts: int,
) -> V4Weights:  # fmt: skip
    """Read every tensor into what the model keeps: projections as LinearWeight-ready pairs
    (`<name>` and, when quantised, `<name minus .weight>.weight_scale_inv` / a format marker), the
    rest in their kept dtype. NaN/Inf are refused (`check_finite`, `check_e8m0`), and so are hash
    routing ids outside [0, num_experts) (`check_expert_ids`)."""
    raw = read_in_file_order((t.file, t.offset, n, source[n]) for n, t in stored.items() if not n.endswith(IGNORED_SUFFIXES))
    out: dict = {}
    for name, tensor in raw.items():
        if name in scales:
            continue
        spec = specs.get(name)
        file = stored[name].file
        if spec is not None and spec.kind in (LINEAR, EXPERT):
            out[name] = _linear(name, tensor, raw, stored, device, dtype, file)
            continue
        if spec is not None and spec.kind == INDEX:
            check_expert_ids(tensor, name, file, num_experts)
            out[name] = tensor.to(device=device, dtype=torch.int64)
            continue
        keep = torch.float32 if spec is not None and spec.kind == FLOAT32 else dtype
        kept = tensor.to(device=device, dtype=keep) if tensor.is_floating_point() else tensor.to(device)
        check_finite(kept, name, file, stored=tensor)
        out[name] = kept
    return V4Weights(out)


def _linear(name, tensor, raw, stored, device, dtype, file) -> LinearWeight:
    scale_name = _scale_name(stored, name)
    if stored[name].dtype in FLOAT_DTYPES:
        kept = tensor.to(device=device, dtype=dtype)
        check_finite(kept, name, file, stored=tensor)
        return LinearWeight(kept)
    scale = raw[scale_name]
    if stored[scale_name].dtype in E8M0:
        check_e8m0(scale, scale_name, file)
    if stored[name].dtype == FP8:
        check_finite(tensor, name, file)
        scale = _e8m0_to_float(scale) if stored[scale_name].dtype in E8M0 else scale.float()
        check_finite(scale, scale_name, file)
        return LinearWeight(tensor.to(device), scale.to(device))
    return LinearWeight(tensor.view(torch.uint8).to(device), scale.view(torch.uint8).to(device), "mxfp4")  # e2m1 codes: all finite
