"""V4.1's CSA2 attention: shared-KV MQA over a sliding window plus the compressed entries its top-k selects.

Per token: q = wq_b(q_norm(wq_a x)) per head, rotated (no per-head q normalisation, unlike V4); one window row
kv = the rotated kv_norm(wkv x) stored in FP8 (caches.py) and read back, keys and values alike; with compress ratio > 0, the KV source's
compressed entries chosen by the top-k owner's selection (a Full layer compresses and selects, a Reindex layer
selects, a Reuse layer reads both: roles.py); one softmax over the window, the selected entries and a sink per
head (`sparse_attention`); the output rotated back, then the grouped low-rank output projection. Layers with
ratio > 0 rotate with the compressed RoPE (YaRN), ratio-0 layers with the plain one.
"""

from __future__ import annotations

import torch

from deepinfer.model.deepseek_v4.attention import grouped_output_projection
from deepinfer.model.deepseek_v41.caches import ENTRY_FORMAT, INDEX_KEY_FORMAT, WINDOW_FORMAT, LayerState, history_rows, read
from deepinfer.model.deepseek_v41.compressor import V41Compressor
from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.decode_plan import V41DecodePlan
from deepinfer.model.deepseek_v41.indexer import V41Indexer
from deepinfer.model.deepseek_v41.roles import LayerRole
from deepinfer.model.deepseek_v41.spans import SharedBatchKV, SharedKV, Span, rotate_tail


class V41Attention:
    def __init__(self, config: V41Config, role: LayerRole, weights, prefix: str):
        c = self.config = config
        self.role, self.ratio = role, role.ratio
        self.heads, self.dim, self.rope_dim, self.eps = c.num_attention_heads, c.head_dim, c.qk_rope_head_dim, c.rms_norm_eps
        self.wq_a, self.wq_b, self.wkv = (weights.linear(f"{prefix}{n}") for n in ("wq_a", "wq_b", "wkv"))
        self.q_norm, self.kv_norm = weights.tensor(f"{prefix}q_norm.weight"), weights.tensor(f"{prefix}kv_norm.weight")
        self.wo_a = weights.grouped(f"{prefix}wo_a", c.o_groups)  # [G * O, H * D / G]: group g's rows are g*O:(g+1)*O
        self.wo_b = weights.linear(f"{prefix}wo_b")
        self.sinks = weights.tensor(f"{prefix}attn_sink").float()
        self.compressor = V41Compressor(weights, prefix, ratio=self.ratio, eps=self.eps, rope_dim=self.rope_dim) if role.has_compressor else None
        self.indexer = V41Indexer(c, role, weights, prefix) if role.has_indexer else None

    def __call__(self, ops, x: torch.Tensor, positions: torch.Tensor, spans: list[Span], state: LayerState,
                 shared: list[SharedKV], ropes: dict) -> torch.Tensor:  # fmt: skip
        """x: [T, hidden] (the normed layer input) of every sequence's new tokens; state: this layer's (caches.py);
        shared: each sequence's CSA2 state from the layers before (updated here by Full and Reindex layers)."""
        cos_sin, inverse = ropes["compress" if self.ratio else "main"]
        q_latent, q = self.queries(ops, x, positions, cos_sin)
        stored = ops.cache_pack(self._rotated_kv(ops, x, positions, cos_sin), fmt=WINDOW_FORMAT)  # the window rows as the ring keeps them
        kv = read(ops, stored, WINDOW_FORMAT, self.dim, x.dtype)
        projected = self.compressor.projections(ops, x) if self.compressor is not None else None
        index_q = self.indexer.queries(ops, x, q_latent, positions, cos_sin) if self.indexer is not None else None
        out = torch.empty_like(q)
        for span, kv_state in zip(spans, shared):
            rows = span.rows
            keys, window = self._window(ops, kv[rows], stored[rows], span, state)
            extra = {}
            if self.ratio:
                if self.compressor is not None:  # a Full layer: its own entries replace the state handed on
                    count = self.compressor(ops, projected, span, state, cos_sin, x.dtype)
                    # read once here, through the block table, for every layer that borrows them (Reuse, Reindex)
                    history = history_rows(span.pages, 0, count, state.entries.shape[1])
                    kv_state.entries = read(ops, state.entries.view(-1, state.entries.shape[-1])[history], ENTRY_FORMAT, self.dim, x.dtype)
                    keys_flat = state.index_keys.view(-1, state.index_keys.shape[-1])
                    kv_state.index_keys = read(ops, keys_flat[history], INDEX_KEY_FORMAT, self.config.index_head_dim, x.dtype)
                    kv_state.topk = kv_state.blocks = None
                    kv_state.ratio = self.ratio
                if self.indexer is not None and kv_state.entries.shape[0]:
                    self.indexer.select(ops, index_q[0][rows], index_q[1][rows], span, kv_state, positions[rows])
                if kv_state.entries.shape[0]:  # no complete group yet: nothing to attend beyond the window
                    extra = {"extra_kv": kv_state.entries, "extra_indices": kv_state.topk}
            out[rows] = ops.sparse_attention(q[rows], keys, window, self.sinks, softmax_scale=self.dim**-0.5, **extra)
        out = rotate_tail(ops, out, self.rope_dim, positions, inverse)
        return self.project(ops, out)

    def decode(self, ops, x: torch.Tensor, plan: V41DecodePlan, state: LayerState, shared: SharedBatchKV, ropes: dict) -> torch.Tensor:
        """A decode step's attention (decode_plan.py), one token per row of x [B, hidden], the whole batch in one
        `sparse_attention`: each token's window rows gathered from its slot's ring, its selected entries beside them."""
        cos_sin, inverse = ropes["compress" if self.ratio else "main"]
        positions = plan.positions
        q_latent, q = self.queries(ops, x, positions, cos_sin)
        stored = ops.cache_pack(self._rotated_kv(ops, x, positions, cos_sin), fmt=WINDOW_FORMAT)
        ring = state.ring.view(-1, state.ring.shape[-1])
        # torch glue: an index_put of one ring row per token (padding rows: the scratch slot's), then a gather of each
        # token's [window] rows (its own among them), read back [B * window, head_dim] for the one attention call
        ring[plan.ring_write] = stored
        window = read(ops, ring[plan.window_rows], WINDOW_FORMAT, self.dim, x.dtype).flatten(0, 1)
        extra = {}
        if self.ratio:
            if self.compressor is not None:  # a Full layer: its own entries replace the state handed on
                ratio = plan.ratios[self.ratio]
                self.compressor.decode(ops, self.compressor.projections(ops, x), ratio, state, cos_sin, x.dtype)
                shared.take_source(ops, state.entries, state.index_keys, ratio.entry_table, ratio.visible, self.config.index_head_dim, x.dtype)
            if self.indexer is not None:
                iq, weights = self.indexer.queries(ops, x, q_latent, positions, cos_sin)
                self.indexer.select_batch(ops, iq, weights, shared, self.dim, x.dtype)
            extra = {"extra_kv": shared.selected, "extra_indices": shared.selected_indices}
        out = ops.sparse_attention(q, window, plan.window_indices, self.sinks, softmax_scale=self.dim**-0.5, **extra)
        out = rotate_tail(ops, out, self.rope_dim, positions, inverse)
        return self.project(ops, out)

    def queries(self, ops, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed q latent [T, q_lora_rank], the rotated queries [T, heads, head_dim])."""
        q_latent, _ = ops.rms_norm(self.wq_a(ops, x), self.q_norm, eps=self.eps)
        q = rotate_tail(ops, self.wq_b(ops, q_latent).view(x.shape[0], self.heads, self.dim), self.rope_dim, positions, cos_sin)
        return q_latent, q

    def _rotated_kv(self, ops, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """Each token's window row [T, head_dim] before the cache's rounding: kv_norm(wkv x), its rope channels rotated."""
        kv, _ = ops.rms_norm(self.wkv(ops, x), self.kv_norm, eps=self.eps)
        return rotate_tail(ops, kv[:, None, :], self.rope_dim, positions, cos_sin)[:, 0]

    def window_kv(self, ops, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """Each token's window row [T, head_dim] as the ring gives it back (FP8-rounded; keys and values alike): what
        DSpark's stages attend to beside their context."""
        return ops.cache_round(self._rotated_kv(ops, x, positions, cos_sin), fmt=WINDOW_FORMAT)

    def project(self, ops, out: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [T, heads, head_dim] (rotated back) through the grouped low-rank projection -> [T, hidden]."""
        return grouped_output_projection(ops, out, self.wo_a, self.wo_b, self.config.o_groups)

    def _window(self, ops, kv_new: torch.Tensor, stored_new: torch.Tensor, span: Span, state: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
        """(the keys the span's window reaches: the ring's rows of earlier positions, then the new rows; and each
        new token's window as rows of those keys [length, window] int32, -1 before position 0 and before the span's
        `window_from`: the ring rows there were never computed). The new rows (stored: `stored_new`) are then
        written into the ring, whose rows past the window are speculative slack (caches.py)."""
        window, ring_rows = self.config.sliding_window, state.ring.shape[1]
        low = max(0, span.window_from, span.start - window + 1)  # the earliest position any new token's window reaches
        earlier = torch.arange(low, span.start, device=kv_new.device)
        keys = torch.cat((read(ops, state.ring[span.slot, earlier % ring_rows], WINDOW_FORMAT, self.dim, kv_new.dtype), kv_new))
        seen = torch.arange(span.start, span.end, device=kv_new.device)[:, None] + torch.arange(1 - window, 1, device=kv_new.device)
        rows = torch.where(seen >= max(0, span.window_from), seen - low, -1).to(torch.int32)
        last = torch.arange(max(span.start, span.end - ring_rows), span.end, device=kv_new.device)
        state.ring[span.slot, last % ring_rows] = stored_new[last - span.start]
        return keys, rows

