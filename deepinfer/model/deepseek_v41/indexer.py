"""V4.1's indexer (index-source layers: Full and Reindex): which compressed entries each new token attends to.

Queries from the attention's q latent (`indexer.wq_b`, rotated, rounded to MXFP4), per-head weights from the
layer input, scored against the index keys of the layer's KV source. A Full layer ranks every visible entry; the
candidate source also keeps its candidate blocks for later Reindex layers, which then select inside them.
"""

from __future__ import annotations

import torch

from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.roles import LayerRole
from deepinfer.model.deepseek_v41.spans import SharedBatchKV, SharedKV, Span, rotate_tail


class V41Indexer:
    def __init__(self, config: V41Config, role: LayerRole, weights, prefix: str):
        c = self.config = config
        self.role = role
        self.wq_b = weights.linear(f"{prefix}indexer.wq_b")
        self.weights_proj = weights.linear(f"{prefix}indexer.weights_proj")
        self.scale = c.index_head_dim**-0.5 * c.index_n_heads**-0.5
        self.is_candidate_source = role.layer == c.candidate_source_layer_id

    def queries(self, ops, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
        """(rounded index queries [T, H, D], head weights [T, H]) of the step's tokens; the weights in the projection's
        dtype, unscaled: the selection ops convert and scale them (weights_scale) in their kernels."""
        c = self.config
        iq = self.wq_b(ops, q_latent).view(x.shape[0], c.index_n_heads, c.index_head_dim)
        iq = ops.cache_round(rotate_tail(ops, iq, c.qk_rope_head_dim, positions, cos_sin), fmt="mxfp4")
        return iq, self.weights_proj(ops, x)

    def select(self, ops, iq: torch.Tensor, weights: torch.Tensor, span: Span, shared: SharedKV, positions: torch.Tensor) -> None:
        """Replace the span's selection (and, at the candidate source, its candidate blocks) in `shared`."""
        c = self.config
        keys = shared.index_keys
        entry_rows = torch.arange(keys.shape[0], dtype=torch.int32, device=keys.device)[None, :]  # the history is the pool
        token_seq = torch.zeros(span.length, dtype=torch.int32, device=keys.device)
        visible = ((positions + 1) // self.role.ratio).to(torch.int32)
        args = (iq, weights, keys, entry_rows, token_seq, visible)
        if self.role.candidate_filtered:
            shared.topk = ops.indexer_topk_in_blocks(*args, shared.blocks, top_k=c.index_topk, block_size=c.candidate_block_size, weights_scale=self.scale)
            return
        shared.topk = ops.indexer_topk(*args, top_k=c.index_topk, weights_scale=self.scale)
        if self.is_candidate_source:
            shared.blocks = ops.candidate_blocks(*args, block_size=c.candidate_block_size, top_blocks=c.candidate_topk_blocks, weights_scale=self.scale)

    def select_batch(self, ops, iq: torch.Tensor, weights: torch.Tensor, shared: SharedBatchKV, head_dim: int, dtype: torch.dtype) -> None:
        """A decode step's `select` (decode_plan.py): every token's selection at once over its sequence's entries."""
        c = self.config
        args = (iq, weights, shared.index_keys, shared.key_rows, shared.token_seq, shared.visible)
        if self.role.candidate_filtered:
            topk = ops.indexer_topk_in_blocks(*args, shared.blocks, top_k=c.index_topk, block_size=c.candidate_block_size, weights_scale=self.scale)
        else:
            topk = ops.indexer_topk(*args, top_k=c.index_topk, weights_scale=self.scale)
            if self.is_candidate_source:
                shared.blocks = ops.candidate_blocks(*args, block_size=c.candidate_block_size, top_blocks=c.candidate_topk_blocks, weights_scale=self.scale)
        shared.select(ops, topk, head_dim, dtype)
