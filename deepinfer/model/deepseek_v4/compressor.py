"""A V4 compressor: projections, the `compress_kv` op over each window, norm and rope, into its pool.

CSA layers hold two (the attention's entries at head_dim, and the indexer's keys at
index_head_dim, both with overlapping windows); HCA layers one, without overlap.
"""

from __future__ import annotations

import torch

from deepinfer.model.deepseek_v4.caches import CompressorCache
from deepinfer.model.deepseek_v4.decode_plan import RingPlan
from deepinfer.model.deepseek_v4.step import V4Step
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
    def __init__(self, weights: WeightStore, prefix: str, *, ratio: int, overlap: bool, rope_dim: int, eps: float):
        self.wkv = weights.linear(f"{prefix}wkv")
        self.wgate = weights.linear(f"{prefix}wgate")
        self.position_bias = weights.tensor(f"{prefix}ape")
        self.norm = weights.tensor(f"{prefix}norm.weight")
        self.ratio, self.overlap, self.rope_dim, self.eps = ratio, overlap, rope_dim, eps

    def __call__(self, ops, x: torch.Tensor, cache: CompressorCache, step: V4Step, cos_sin: torch.Tensor) -> None:
        """Emit the entries whose window closes in this step into the pool, and keep the open windows' tokens in the ring."""
        plan = step.compressors[(self.ratio, self.overlap)]
        kv = self.wkv(ops, x).float()
        gate = self.wgate(ops, x).float()
        if isinstance(plan, RingPlan):
            self._pool_in_ring(ops, x.dtype, kv, gate, cache, plan, cos_sin)
            return
        flat_kv, flat_gate = cache.ring_kv.view(-1, kv.shape[1]), cache.ring_gate.view(-1, gate.shape[1])
        if plan.window_starts.numel():
            sources_kv = torch.cat((flat_kv[plan.history], kv))[plan.order]
            sources_gate = torch.cat((flat_gate[plan.history], gate))[plan.order]
            entries = ops.compress_kv(
                sources_kv, sources_gate, self.position_bias, plan.window_starts, plan.prev_starts, ratio=self.ratio, overlap=self.overlap
            )
            self._emit(ops, entries.to(x.dtype), plan.positions, plan.pool_rows, cache.pool, cos_sin)
        flat_kv[plan.ring_rows] = kv[plan.ring_tokens]
        flat_gate[plan.ring_rows] = gate[plan.ring_tokens]

    def _pool_in_ring(self, ops, dtype: torch.dtype, kv: torch.Tensor, gate: torch.Tensor, cache: CompressorCache, plan: RingPlan, cos_sin) -> None:
        """A decode step (decode_plan): each token's projections into its ring row first (kv_cache_write, the ring
        viewed as one page of `ring` rows per state slot, rows -1 skipped), then the windows that close pooled in
        place from the ring (window start -1: none closes, a zero row written nowhere)."""
        ops.kv_cache_write(kv, kv[:, :0], cache.ring_kv, plan.ring_rows)
        ops.kv_cache_write(gate, gate[:, :0], cache.ring_gate, plan.ring_rows)
        flat_kv, flat_gate = cache.ring_kv.view(-1, kv.shape[1]), cache.ring_gate.view(-1, gate.shape[1])
        entries = ops.compress_kv(flat_kv, flat_gate, self.position_bias, plan.window_starts, plan.prev_starts, ratio=self.ratio, overlap=self.overlap)
        self._emit(ops, entries.to(dtype), plan.positions, plan.pool_rows, cache.pool, cos_sin)

    def _emit(self, ops, entries: torch.Tensor, positions: torch.Tensor, pool_rows: torch.Tensor, pool: torch.Tensor, cos_sin) -> None:
        """Norm the entries, rotate their rope channels at their positions, write them to their pool rows (-1: none)."""
        entries, _ = ops.rms_norm(entries, self.norm, eps=self.eps)
        dim = entries.shape[1]
        rotated = ops.rope(entries[:, None, dim - self.rope_dim :].contiguous(), positions, cos_sin, interleaved=True)[:, 0]
        ops.kv_cache_write(entries[:, : dim - self.rope_dim].contiguous(), rotated, pool, pool_rows)
