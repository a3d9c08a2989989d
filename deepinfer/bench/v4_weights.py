"""Random DeepSeek-V4 weights in the formats DeepSeek's release keeps, drawn on the device as the model takes them.

`RandomV4Weights` is a `V4Weights` (the store the V4 loader fills, deepinfer/model/deepseek_v4/
checkpoint.py) whose tensors are drawn when `DeepseekV4ForCausalLM.load_weights` takes them, so a
layer's weights exist only from the moment the model builds that layer: nothing goes through the
host or a disk, and the bench never holds two copies of the model.

Formats (`weight_format`), as the V4-Flash release stores its projections (its
`model.safetensors.index.json` lists a `.scale` for exactly these):
- "fp8_block": the attention projections (wq_a, wq_b, wkv, wo_a, wo_b), the indexer's wq_b and the
  shared expert: e4m3 weights with a float32 multiplier per 128x128 block (the loader turns the
  release's e8m0 scales into these), run through the `linear` / `grouped_gemm` "fp8_block" format;
- "mxfp4": the routed experts: e2m1 codes packed two per byte with an e8m0 scale per 32 columns;
- the model dtype: the embedding, the head, the compressors' wkv / wgate and the indexer's
  weights_proj (the release keeps these in bf16); float32: norms, sinks, position biases,
  hyper-connection tensors and the router, as the loader keeps them; int64: the hash-routing table.

Values: fp8 weights are N(0, 1) codes with the block scale fan_in^-1/2 (effective N(0, 1/fan_in));
mxfp4 codes are uniform random bytes with the power-of-two scale closest to fan_in^-1/2 over the
codes' RMS (sqrt(8.5625)); the rest follow the embedded tiny-v4's recipe (`random_v4_value`), except
the router's correction bias, which is zero: routing then spreads near-uniformly over the experts,
as the floor's expected count of distinct experts assumes (random biases of the tiny model's spread
would send most tokens to a few experts); tid2eid gives each vocabulary entry distinct random experts.
"""

from __future__ import annotations

import math

import torch

from deepinfer.model.deepseek_v4.checkpoint import V4Weights
from deepinfer.model.deepseek_v4.config import V4Config
from deepinfer.model.deepseek_v4.model import model_tensor_specs
from deepinfer.model.deepseek_v4.moe import EXPERT, INDEX
from deepinfer.model.embedded import random_v4_value
from deepinfer.model.linear import LinearWeight
from deepinfer.model.weights import FLOAT32, LINEAR, TensorSpec
from deepinfer.ops.quant import E2M1_VALUES, E8M0_BIAS, FP8_BLOCK, FP8_DTYPE, MX_BLOCK

FP8, MXFP4 = "fp8_block", "mxfp4"
BF16_PROJECTIONS = (".compressor.", ".weights_proj.")  # projections the release keeps in bf16
E2M1_RMS = math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))  # of uniform random codes


def weight_format(name: str, spec: TensorSpec) -> str:
    """How the bench keeps a tensor: "fp8_block", "mxfp4", "float32", "index" or "dtype" (the model dtype)."""
    if spec.kind == EXPERT:
        return MXFP4
    if spec.kind == LINEAR:
        return "dtype" if any(part in name for part in BF16_PROJECTIONS) else FP8
    if spec.kind == FLOAT32:
        return "float32"
    if spec.kind == INDEX:
        return "index"
    return "dtype"


def kept_bytes(name: str, spec: TensorSpec, dtype_bytes: int) -> int:
    """Device bytes of a tensor as the model keeps it (weight plus its scales)."""
    numel = math.prod(spec.shape)
    fmt = weight_format(name, spec)
    if fmt == FP8:
        rows, cols = spec.shape
        return numel + math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK) * 4
    if fmt == MXFP4:
        return numel // 2 + numel // MX_BLOCK
    return numel * {"float32": 4, "index": 8}.get(fmt, dtype_bytes)


def mxfp4_scale_byte(fan_in: int) -> int:
    """The e8m0 byte whose power of two is closest to fan_in^-1/2 / E2M1_RMS: weights of RMS ~ fan_in^-1/2."""
    return E8M0_BIAS + round(math.log2(fan_in**-0.5 / E2M1_RMS))


class RandomV4Weights(V4Weights):
    """Every tensor of `config`'s model, drawn on `device` when the model takes it (see the module
    docstring for formats and values). One generator seeded once: the model takes its tensors in a
    fixed order, so the draws repeat from run to run."""

    def __init__(self, config: V4Config, device: torch.device, dtype: torch.dtype, seed: int = 0):
        super().__init__({})
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._pending = model_tensor_specs(config)

    def _take(self, name: str) -> TensorSpec:
        if name not in self._pending:
            raise KeyError(name)
        return self._pending.pop(name)

    def tensor(self, name: str) -> torch.Tensor:
        spec = self._take(name)
        g, dev = self.generator, self.device
        if spec.kind == INDEX:  # distinct random experts per vocabulary entry
            scores = torch.rand(spec.shape[0], self.config.n_routed_experts, generator=g, device=dev)
            return scores.argsort(dim=1)[:, : spec.shape[1]].contiguous()
        if name.endswith("gate.bias"):
            return torch.zeros(spec.shape, dtype=torch.float32, device=dev)
        value = random_v4_value(name, spec.shape, g, dev)
        return value.float() if spec.kind == FLOAT32 else value.to(self.dtype)

    def linear(self, prefix: str) -> LinearWeight:
        name = f"{prefix}.weight"
        spec = self._take(name)
        g, dev = self.generator, self.device
        rows, cols = spec.shape
        fmt = weight_format(name, spec)
        if fmt == MXFP4:
            packed = torch.randint(0, 256, (rows, cols // 2), generator=g, device=dev, dtype=torch.uint8)
            scale = torch.full((rows, cols // MX_BLOCK), mxfp4_scale_byte(cols), dtype=torch.uint8, device=dev)
            return LinearWeight(packed, scale, MXFP4)
        if fmt == FP8:
            codes = torch.randn(rows, cols, generator=g, device=dev).to(FP8_DTYPE)
            scale = torch.full((math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)), cols**-0.5, dtype=torch.float32, device=dev)
            return LinearWeight(codes, scale)
        return LinearWeight(random_v4_value(name, spec.shape, g, dev).to(self.dtype))

    def take_prefix(self, prefix: str) -> dict[str, torch.Tensor]:
        return {}  # no MTP layers

    def remaining(self) -> list[str]:
        return sorted(self._pending)
