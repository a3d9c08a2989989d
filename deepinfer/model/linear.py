"""Weights of the model's matrix products, in the format the checkpoint stores them.

A dense weight is a float tensor; an FP8 one (DeepSeek-V3's checkpoints) stays float8_e4m3fn with
its float32 multiplier per 128x128 block (the checkpoint's `weight_scale_inv`) and runs through the
"fp8_block" format of the `linear` / `grouped_gemm` ops. Other formats are named (`format`): "mxfp4"
(packed e2m1, e8m0 per 32 columns) and "fp8_block32" (DeepSeek-V4.1's e4m3 with an e8m0 byte per
32x32 block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.ops import quant


@dataclass
class LinearWeight:
    """W [N, K] (dense) or W fp8 [N, K] with scale [ceil(N/128), ceil(K/128)]; `x @ W^T` via ops.linear."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    format: str | None = None  # None: "dense" without a scale, "fp8_block" with one; or an `ops.gemm.FORMATS` name ("mxfp4", "fp8_block32")

    @property
    def fmt(self) -> str:
        return self.format or ("dense" if self.scale is None else "fp8_block")

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]

    def __call__(self, ops, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, weight_scale=self.scale, fmt=self.fmt)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.scale is None:
            return self.weight.to(dtype)
        if self.fmt == "fp8_block32":
            return quant.dequantize_weight_fp8_block32(self.weight, self.scale, dtype=dtype)
        if self.fmt != "fp8_block":
            raise ValueError(f"no dequantisation here for the {self.fmt} format")
        return quant.dequantize_weight_fp8_block(self.weight, self.scale, dtype=dtype)


@dataclass
class ExpertWeights:
    """Every expert's W stacked: [E, N, K] (fp8: scale [E, ceil(N/128), ceil(K/128)]); via ops.grouped_gemm."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    format: str | None = None  # as LinearWeight.format

    @property
    def fmt(self) -> str:
        return self.format or ("dense" if self.scale is None else "fp8_block")

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]

    def __call__(self, ops, x: torch.Tensor, expert_offsets: torch.Tensor | None = None, *, masked_m: torch.Tensor | None = None) -> torch.Tensor:
        """The contiguous layout (x [M, K], expert_offsets) or the masked one (x [E, max_m, K], masked_m)."""
        return ops.grouped_gemm(x, self.weight, expert_offsets=expert_offsets, masked_m=masked_m, weight_scale=self.scale, fmt=self.fmt)

    @staticmethod
    def stack(experts: list[LinearWeight]) -> "ExpertWeights":
        weight = torch.stack([e.weight for e in experts])
        scales = [e.scale for e in experts]
        if len({e.fmt for e in experts}) > 1:
            raise ValueError(f"experts of one layer mix weight formats: {sorted({e.fmt for e in experts})}")
        if all(s is None for s in scales):
            return ExpertWeights(weight)
        return ExpertWeights(weight, torch.stack(scales), experts[0].format)


# Weight rows sharing one scale row, for the formats whose scales cover blocks of rows (others: one row each).
_SCALE_BLOCK_ROWS = {"fp8_block": quant.FP8_BLOCK, "fp8_block32": quant.FP8_BLOCK32}


def _fusable(parts: list) -> bool:
    """Weights concatenated along N keep their scale blocks only if every part but the last fills whole blocks."""
    formats = {p.fmt for p in parts}
    if len(formats) > 1:
        return False
    rows = _SCALE_BLOCK_ROWS.get(formats.pop(), 1)
    return all(p.out_features % rows == 0 for p in parts[:-1])


def _concat(parts: list, dim: int):
    kind = type(parts[0])
    weight = torch.cat([p.weight for p in parts], dim=dim)
    scale = None if parts[0].scale is None else torch.cat([p.scale for p in parts], dim=dim)
    return kind(weight, scale, parts[0].format)


def _row_views(fused: LinearWeight, parts: list[LinearWeight]) -> tuple[LinearWeight, ...]:
    """Each part as a view of its rows of the fused weight and of its scale rows (which `_concat` stacked
    in the same order): the parts without copies of their own."""
    views, row, scale_row = [], 0, 0
    for p in parts:
        rows, scale_rows = p.weight.shape[0], 0 if p.scale is None else p.scale.shape[0]
        scale = None if fused.scale is None else fused.scale[scale_row : scale_row + scale_rows]
        views.append(LinearWeight(fused.weight[row : row + rows], scale, p.format))
        row, scale_row = row + rows, scale_row + scale_rows
    return tuple(views)


@dataclass
class FusedLinear:
    """Several weights applied to the same input, outputs concatenated (gate then up).

    One fused weight when the formats allow it (always for dense weights); otherwise the parts run
    one after the other and their outputs are concatenated. `given` keeps each weight as it was
    given (views of the fused rows: no second copy), for callers that still name them.
    """

    parts: tuple[LinearWeight, ...]
    given: tuple[LinearWeight, ...] = ()

    @staticmethod
    def of(parts: list[LinearWeight]) -> "FusedLinear":
        if not _fusable(parts):
            return FusedLinear(tuple(parts), tuple(parts))
        fused = _concat(parts, dim=0)
        return FusedLinear((fused,), _row_views(fused, parts))

    def __call__(self, ops, x: torch.Tensor) -> torch.Tensor:
        outs = [p(ops, x) for p in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def split(self, ops, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each given weight's product, in order: column views of the one fused product (one GEMM, one
        activation quantisation), or each part's own product when the formats kept them apart (no concatenation)."""
        if len(self.parts) == len(self.given):
            return tuple(p(ops, x) for p in self.parts)
        return tuple(torch.split(self.parts[0](ops, x), [g.out_features for g in self.given], dim=-1))


@dataclass
class FusedExperts:
    """FusedLinear for stacked experts: gate and up of every expert, concatenated along N."""

    parts: tuple[ExpertWeights, ...]

    @staticmethod
    def of(parts: list[ExpertWeights]) -> "FusedExperts":
        return FusedExperts((_concat(parts, dim=1),) if _fusable(parts) else tuple(parts))

    def __call__(self, ops, x: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
        outs = [p(ops, x, expert_offsets) for p in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
