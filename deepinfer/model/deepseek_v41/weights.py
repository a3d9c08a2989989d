"""V4.1's tensors as the model uses them: FP4 experts kept packed, other quantised weights decoded once.

The routed experts' FP4 (e2m1 pairs, e8m0 per 32 columns) is exactly the registry's "mxfp4" weight
format, so they stay packed and the grouped GEMM reads them as stored. The dense projections' FP8 e4m3
with e8m0 scales per 32x32 block has no registry format yet (`fp8_block` is DeepSeek-V3's 128x128 with
float32 scales): they are decoded to the model dtype at load, as NeMo Automodel's V4.1 code decodes them.
A `fp8_block32` GEMM format will replace the decoding. Engram tables (FP8 rows) are decoded likewise.
"""

from __future__ import annotations

import torch

from deepinfer.model.deepseek_v41.checkpoint import QuantizedTensor
from deepinfer.model.deepseek_v41.tensors import FP4_EXPERT
from deepinfer.model.linear import LinearWeight


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
    """`read_v41_tensors`' output by name: floats as read, quantised weights decoded on access (FP4 experts kept)."""

    def __init__(self, tensors: dict, dtype: torch.dtype):
        self.tensors, self.dtype = tensors, dtype

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> torch.Tensor:
        """A float tensor (a quantised one decoded to the model dtype)."""
        t = self.tensors[name]
        return decode_fp8_blocks(t, self.dtype) if isinstance(t, QuantizedTensor) else t

    def linear(self, base: str) -> LinearWeight:
        """The projection `<base>.weight`: dense, or packed MXFP4 for an FP4 expert stored packed."""
        t = self.tensors[f"{base}.weight"]
        if isinstance(t, QuantizedTensor) and t.fmt == FP4_EXPERT:
            return LinearWeight(t.data, t.scale, format="mxfp4")
        return LinearWeight(self.tensor(f"{base}.weight"))
