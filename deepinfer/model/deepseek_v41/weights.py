"""V4.1's tensors as the model uses them: FP8 projections and FP4 experts kept as stored, Engram tables decoded once.

- The dense projections' FP8 (e4m3 with an e8m0 byte per 32x32 block) is the registry's "fp8_block32" weight
  format: they stay 1 byte a weight (plus a byte per block) and the GEMM ops read them as stored. The format is
  W8A16 (the activations are not quantised): the products equal those of NeMo Automodel's V4.1 code, which
  decodes these weights to BF16 and multiplies in BF16 (e4m3 * 2^k is exact in bf16), so the forward's numbers
  are those of decoding at load. wo_a's grouped projection keeps its FP8 too (one "expert" per group) when each
  group's rows fill whole 32-row blocks.
- The routed experts' FP4 (e2m1 pairs, e8m0 per 32 columns) is exactly the registry's "mxfp4" weight format,
  so they stay packed and the grouped GEMM reads them as stored.
- Engram tables (FP8 rows, e8m0 per row and 32 columns) are decoded to the model dtype at load: a row gather,
  not a GEMM, reads them.
"""

from __future__ import annotations

import torch

from deepinfer.model.deepseek_v41.checkpoint import QuantizedTensor
from deepinfer.model.deepseek_v41.tensors import FP4_EXPERT, FP8_BLOCK
from deepinfer.model.linear import ExpertWeights, LinearWeight
from deepinfer.ops import quant

FP8_WEIGHT_FORMAT = "fp8_block32"  # the GEMM format of an FP8_BLOCK tensor kept as stored


def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes (uint8) -> float32 powers of two 2^(byte - 127)."""
    return torch.exp2(scale.to(torch.float32) - 127)


def decode_fp8_blocks(q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 weight with e8m0 scales per (rows, columns) block, decoded to `dtype` (partial edge blocks included)."""
    rows, cols = q.data.shape
    br, bc = q.block
    scale = decode_e8m0(q.scale).repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (q.data.float() * scale).to(dtype)


class V41Weights:
    """`read_v41_tensors`' output by name: floats as read, FP8 projections and FP4 experts kept as stored
    (`linear`, `grouped`), other quantised tensors decoded on access (`tensor`)."""

    def __init__(self, tensors: dict, dtype: torch.dtype):
        self.tensors, self.dtype = tensors, dtype

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> torch.Tensor:
        """A float tensor (a quantised one decoded to the model dtype)."""
        t = self.tensors[name]
        return decode_fp8_blocks(t, self.dtype) if isinstance(t, QuantizedTensor) else t

    def linear(self, base: str) -> LinearWeight:
        """The projection `<base>.weight` as stored: FP8 32x32 blocks ("fp8_block32"), packed MXFP4 (an FP4 expert)
        or a float (dense)."""
        t = self.tensors[f"{base}.weight"]
        if isinstance(t, QuantizedTensor) and t.fmt == FP4_EXPERT:
            return LinearWeight(t.data, t.scale, format="mxfp4")
        if isinstance(t, QuantizedTensor) and t.fmt == FP8_BLOCK:
            return LinearWeight(t.data, t.scale, format=FP8_WEIGHT_FORMAT)
        return LinearWeight(self.tensor(f"{base}.weight"))

    def grouped(self, base: str, groups: int) -> ExpertWeights:
        """`<base>.weight` [G * O, K] as G stacked weights [G, O, K] (one grouped-GEMM "expert" per group): kept in
        FP8 when each group's O rows fill whole 32-row scale blocks (the scale [G * O/32, ceil(K/32)] then splits by
        group too), else decoded to the model dtype (a block would straddle two groups)."""
        t = self.tensors[f"{base}.weight"]
        rows, cols = t.data.shape if isinstance(t, QuantizedTensor) else t.shape
        if rows % groups:
            raise ValueError(f"{base}.weight has {rows} rows, not a multiple of its {groups} groups")
        per_group = rows // groups
        if isinstance(t, QuantizedTensor) and t.fmt == FP8_BLOCK and per_group % quant.FP8_BLOCK32 == 0:
            return ExpertWeights(t.data.view(groups, per_group, cols), t.scale.view(groups, per_group // quant.FP8_BLOCK32, -1), FP8_WEIGHT_FORMAT)
        w = self.tensor(f"{base}.weight")
        return ExpertWeights(w.view(groups, per_group, cols), None)
