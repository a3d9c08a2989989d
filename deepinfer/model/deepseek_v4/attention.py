"""V4 attention: shared-KV MQA with a sliding window, plus compressed entries (CSA: the indexer's
top-k; HCA: all of them), attention sinks, partial RoPE, and a grouped low-rank output projection.

Per token: q = wq_b(rms(wq_a x)) per head, RMS-normalised without weight; one KV row
kv = rms(wkv x) (keys and values alike); the last rope_dim channels of both rotated at the token's
position. `sparse_attention` reads the window's rows and the selected entries in one softmax with
the sinks; the output's rope channels are rotated back (V = K carried the key's rotation), then
`wo_a` projects each group of heads (grouped_gemm, one "expert" per group) and `wo_b` mixes them.
"""

from __future__ import annotations

import torch

from deepinfer.model.deepseek_v4.caches import LayerCache
from deepinfer.model.deepseek_v4.compressor import Compressor, compressor_specs
from deepinfer.model.deepseek_v4.config import CSA, SLIDING, V4Config
from deepinfer.model.deepseek_v4.step import V4Step
from deepinfer.model.linear import ExpertWeights, FusedLinear
from deepinfer.model.weights import FLOAT32, LINEAR, TensorSpec, WeightStore


def attention_specs(config: V4Config, layer: int, prefix: str) -> dict[str, TensorSpec]:
    c = config
    hidden, heads, dim = c.hidden_size, c.num_attention_heads, c.head_dim
    specs = {
        f"{prefix}wq_a.weight": TensorSpec((c.q_lora_rank, hidden), LINEAR),
        f"{prefix}q_norm.weight": TensorSpec((c.q_lora_rank,), FLOAT32),
        f"{prefix}wq_b.weight": TensorSpec((heads * dim, c.q_lora_rank), LINEAR),
        f"{prefix}wkv.weight": TensorSpec((dim, hidden), LINEAR),
        f"{prefix}norm.weight": TensorSpec((dim,), FLOAT32),
        f"{prefix}wo_a.weight": TensorSpec((c.o_groups * c.o_lora_rank, heads * dim // c.o_groups), LINEAR),
        f"{prefix}wo_b.weight": TensorSpec((hidden, c.o_groups * c.o_lora_rank), LINEAR),
        f"{prefix}attn_sink": TensorSpec((heads,), FLOAT32),
    }
    kind, ratio = c.layer_types[layer], c.compress_ratio(layer)
    if kind != SLIDING:
        specs.update(compressor_specs(f"{prefix}compressor.", hidden, dim, ratio, overlap=kind == CSA))
    if kind == CSA:
        specs.update(compressor_specs(f"{prefix}indexer.compressor.", hidden, c.index_head_dim, ratio, overlap=True))
        specs[f"{prefix}indexer.wq_b.weight"] = TensorSpec((c.index_n_heads * c.index_head_dim, c.q_lora_rank), LINEAR)
        specs[f"{prefix}indexer.weights_proj.weight"] = TensorSpec((c.index_n_heads, hidden), LINEAR)
    return specs


class V4Attention:
    def __init__(self, config: V4Config, layer: int, weights: WeightStore, prefix: str, dtype: torch.dtype):
        c = self.config = config
        self.kind, self.ratio = c.layer_types[layer], c.compress_ratio(layer)
        self.heads, self.dim, self.rope_dim, self.eps = c.num_attention_heads, c.head_dim, c.qk_rope_head_dim, c.rms_norm_eps
        # wq_a and wkv read the same x: one GEMM (and one activation quantisation) when their formats fuse
        self.q_kv = FusedLinear.of([weights.linear(f"{prefix}wq_a"), weights.linear(f"{prefix}wkv")])
        self.wq_a, self.wkv = self.q_kv.given  # views of the fused rows (no second copy), by their checkpoint names
        self.q_norm = weights.tensor(f"{prefix}q_norm.weight")
        self.wq_b = weights.linear(f"{prefix}wq_b")
        self.kv_norm = weights.tensor(f"{prefix}norm.weight")
        wo_a = weights.linear(f"{prefix}wo_a")  # [G * O, H * D / G]: group g's rows are g*O:(g+1)*O
        groups = c.o_groups
        if wo_a.scale is not None and c.o_lora_rank % 128:
            # FP8 blocks of 128 rows straddle two groups: the groups cannot keep their own scales
            # (V4's o_lora_rank is 1024; only toy widths get here), so this weight is dequantised.
            wo_a = type(wo_a)(wo_a.dequantized(dtype))
        self.wo_a = ExpertWeights(
            wo_a.weight.view(groups, -1, wo_a.weight.shape[-1]), None if wo_a.scale is None else wo_a.scale.view(groups, -1, wo_a.scale.shape[-1])
        )
        self.wo_b = weights.linear(f"{prefix}wo_b")
        self.sinks = weights.tensor(f"{prefix}attn_sink")
        self.compressor = self.indexer = None
        if self.kind != SLIDING:
            self.compressor = Compressor(weights, f"{prefix}compressor.", ratio=self.ratio, overlap=self.kind == CSA, eps=self.eps)
        if self.kind == CSA:
            self.indexer = Compressor(weights, f"{prefix}indexer.compressor.", ratio=self.ratio, overlap=True, eps=self.eps)
            self.index_wq_b = weights.linear(f"{prefix}indexer.wq_b")
            self.index_weights = weights.linear(f"{prefix}indexer.weights_proj")
            self.index_scale = (c.index_n_heads**-0.5) * (c.index_head_dim**-0.5)

    def __call__(self, ops, x: torch.Tensor, cache: LayerCache, step: V4Step, ropes) -> torch.Tensor:
        """x: [T, hidden] (the normed layer input); ropes: (cos_sin, inverse cos_sin) tables by name ("main", "compress")."""
        tokens = x.shape[0]
        cos_sin, inverse = ropes["main" if self.kind == SLIDING else "compress"]
        q_low, kv_raw = self.q_kv.split(ops, x)  # row-strided views of one product: rms_norm reads them as they are
        q_latent, _ = ops.rms_norm(q_low, self.q_norm, eps=self.eps)
        # q's heads normed without weight and their rope channels rotated, in place, in one launch
        q = ops.head_norm_rope(self.wq_b(ops, q_latent).view(tokens, self.heads, self.dim), step.positions, cos_sin, eps=self.eps)
        # the window row: normed, its rope channels rotated, written to its slot (-1: a replayed token's, skipped) in one launch
        ops.norm_rope_kv_write(kv_raw, self.kv_norm, step.positions, cos_sin, cache.swa, step.write_slots, eps=self.eps)
        extra = {}
        if self.compressor is not None:
            self.compressor(ops, x, cache.compressor, step, cos_sin)
            pool = cache.compressor.pool.flatten(0, 1)
            if self.indexer is not None:
                extra = {"extra_kv": pool, "extra_indices": self._selected_rows(ops, x, q_latent, cache, step, cos_sin)}
            else:  # every visible entry: the first num_visible of a row (a decode plan's rows are E_max wide)
                plan = step.ratios[self.ratio]
                extra = {"extra_kv": pool, "extra_indices": plan.visible_rows, "extra_lengths": plan.num_visible}
        # the output's rope channels rotated back in the op's last step (V = K carried the key's rotation)
        out = ops.sparse_attention(q, cache.swa.flatten(0, 1), step.window_rows, self.sinks, softmax_scale=self.config.softmax_scale,
                                   out_positions=step.positions, out_cos_sin_cache=inverse, **extra)  # fmt: skip
        return grouped_output_projection(ops, out, self.wo_a, self.wo_b, self.config.o_groups, step.group_rows)

    def _selected_rows(self, ops, x, q_latent, cache: LayerCache, step: V4Step, cos_sin) -> torch.Tensor:
        """CSA: the indexer's top-k entries of each token, as rows of the entry pool."""
        c = self.config
        self.indexer(ops, x, cache.indexer, step, cos_sin)
        plan = step.ratios[self.ratio]
        iq = self.index_wq_b(ops, q_latent).view(x.shape[0], c.index_n_heads, c.index_head_dim)
        iq = ops.head_norm_rope(iq, step.positions, cos_sin)  # rotated only: the indexer's q heads are not normed
        weights = self.index_weights(ops, x)  # in the projection's dtype: the op converts and scales them in its kernel
        keys = cache.indexer.pool.flatten(0, 1)
        return ops.indexer_topk(iq, weights, keys, plan.entry_rows, step.token_seq, plan.num_visible, top_k=c.index_topk, weights_scale=self.index_scale)


def grouped_output_projection(ops, out: torch.Tensor, wo_a: ExpertWeights, wo_b, groups: int, group_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped low-rank output projection (V4 and V4.1): wo_a per group of heads, as grouped_gemm's masked
    layout over the [G, T, H*D/G] view of out [T, H, D] (no copy: a backend reads it in place, cuda's activation
    quantiser included), then wo_b over [T, G*O], itself a view where the backend wrote wo_a's output in x's memory
    order (cuda). group_rows: [G] int32 of T, the masked layout's counts (made here when not given: a step that
    makes it once spares a launch per layer)."""
    tokens = out.shape[0]
    if group_rows is None:
        group_rows = torch.full((groups,), tokens, dtype=torch.int32, device=out.device)
    low = wo_a(ops, out.reshape(tokens, groups, -1).transpose(0, 1), masked_m=group_rows)  # [G, T, O]
    return wo_b(ops, low.transpose(0, 1).reshape(tokens, -1))
