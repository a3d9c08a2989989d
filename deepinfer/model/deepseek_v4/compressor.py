"""A V4 compressor: projections, the `compress_kv` op over each window, norm and rope, into its pool.

CSA layers hold two (the attention's entries at head_dim, and the indexer's keys at
index_head_dim, both with overlapping windows); HCA layers one, without overlap.
"""

from __future__ import annotations

import torch

from deepinfer.model.deepseek_v4.caches import CompressorCache
from deepinfer.model.deepseek_v4.decode_plan import RingPlan
from deepinfer.model.deepseek_v4.step import V4Step
from deepinfer.model.linear import FusedLinear
from deepinfer.model.weights import FLOAT32, LINEAR, TensorSpec, WeightStore


def compressor_specs(prefix: str, hidden: int, dim: int, ratio: int, overlap: bool) -> dict[str, TensorSpec]:
    width = 2 * dim if overlap else dim
    return {
        f"{prefix}wkv.weight": TensorSpec((width, hidden), LINEAR),
        f"{prefix}wgate.weight": TensorSpec((width, hidden), LINEAR),
        f"{prefix}ape": TensorSpec((ratio, width), FLOAT32),
        f"{prefix}norm.weight": TensorSpec((dim,), FLOAT32),
    }


class Compressor:
    def __init__(self, weights: WeightStore, prefix: str, *, ratio: int, overlap: bool, eps: float):
        # wkv and wgate read the same input: one GEMM whose [T, 2W] output is a ring row per token (value, then gate logits)
        self.projections = FusedLinear.of([weights.linear(f"{prefix}wkv"), weights.linear(f"{prefix}wgate")])
        self.wkv, self.wgate = self.projections.given  # (views of the fused weight's rows)
        self.width = self.wkv.out_features
        self.position_bias = weights.tensor(f"{prefix}ape")
        self.norm = weights.tensor(f"{prefix}norm.weight")
        self.ratio, self.overlap, self.eps = ratio, overlap, eps  # (the rope table's width is the rope dim)

    def __call__(self, ops, x: torch.Tensor, cache: CompressorCache, step: V4Step, cos_sin: torch.Tensor) -> None:
        """Emit the entries whose window closes in this step into the pool, and keep the open windows' tokens in the ring."""
        plan = step.compressors[(self.ratio, self.overlap)]
        projected = self.projections(ops, x)  # [T, 2W] in x's dtype
        if isinstance(plan, RingPlan):
            self._pool_in_ring(ops, projected, cache, plan, cos_sin)
            return
        flat = cache.projections.view(-1, 2 * self.width)
        projected = projected.to(flat.dtype)  # the ring's float32 (exact)
        if plan.window_starts.numel():
            sources = torch.cat((flat[plan.history], projected))[plan.order]
            entries = self._compress(ops, sources, plan.window_starts, plan.prev_starts)
            ops.norm_rope_kv_write(entries, self.norm, plan.positions, cos_sin, cache.pool, plan.pool_rows, eps=self.eps)
        flat[plan.ring_rows] = projected[plan.ring_tokens]

    def _pool_in_ring(self, ops, projected: torch.Tensor, cache: CompressorCache, plan: RingPlan, cos_sin) -> None:
        """A decode step (decode_plan), four launches: the projections GEMM; each token's projections into its
        ring row (kv_cache_write, the ring viewed as one page of `ring` rows per state slot, rows -1 skipped,
        cast to the ring's float32 on store); the windows that close pooled in place from the ring (window start
        -1: none closes, a zero row written nowhere); the entries normed, rotated and written to the pool."""
        ops.kv_cache_write(projected, projected[:, :0], cache.projections, plan.ring_rows)
        entries = self._compress(ops, cache.projections.view(-1, 2 * self.width), plan.window_starts, plan.prev_starts)
        ops.norm_rope_kv_write(entries, self.norm, plan.positions, cos_sin, cache.pool, plan.pool_rows, eps=self.eps)

    def _compress(self, ops, rows: torch.Tensor, window_starts: torch.Tensor, prev_starts: torch.Tensor) -> torch.Tensor:
        """compress_kv over ring-layout rows [N, 2W] (column views: the kernels take row-strided inputs); float32 entries [E, D]."""
        kv, gate = rows[:, : self.width], rows[:, self.width :]
        return ops.compress_kv(kv, gate, self.position_bias, window_starts, prev_starts, ratio=self.ratio, overlap=self.overlap)
