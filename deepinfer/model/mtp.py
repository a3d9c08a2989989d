"""DeepSeek-V3's multi-token prediction (MTP) module, run as the draft model of speculative decoding.

The checkpoint stores it as the decoder layer after the last one (`model.layers.{N}.*`, N =
num_hidden_layers; V3: layer 61) with four extra tensors. At position p it reads the embedding of
token p+1 and a hidden state of position p and predicts token p+2:

    x = eh_proj([enorm(embed(token[p+1])), hnorm(h[p])])     (the embedding is zero at position 0)
    y = block(x) + its residual                               (one full MLA + MoE decoder layer)
    logits = head(shared_head.norm(y))

h[p] is the target's final hidden state (after its final norm) for the first draft, and y of the
previous draft for the next ones (chained drafts: vLLM's convention). The embedding and the head
are the target's (the checkpoint's `embed_tokens` / `shared_head.head` copies of them are dropped);
the block has its own paged latent cache, indexed by the target's block tables.
"""

from __future__ import annotations

import torch

from deepinfer.model.config import ModelConfig
from deepinfer.model.weights import LINEAR, PARAM, TensorSpec, WeightStore

SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # the target's tensors, stored again


def mtp_extra_specs(config: ModelConfig, prefix: str) -> dict[str, TensorSpec]:
    """The MTP tensors beside its decoder layer's (the shared copies are optional)."""
    hidden = config.hidden_size
    return {
        f"{prefix}enorm.weight": TensorSpec((hidden,), PARAM),
        f"{prefix}hnorm.weight": TensorSpec((hidden,), PARAM),
        f"{prefix}eh_proj.weight": TensorSpec((hidden, 2 * hidden), LINEAR),
        f"{prefix}shared_head.norm.weight": TensorSpec((hidden,), PARAM),
    }


class MTPLayer:
    """One MTP module; `block` is its decoder layer (built by the model from the same weights)."""

    def __init__(self, config: ModelConfig, weights: WeightStore, prefix: str, block, embed_tokens: torch.Tensor, lm_head: torch.Tensor):
        self.eps = config.rms_norm_eps
        self.enorm = weights.tensor(f"{prefix}enorm.weight")
        self.hnorm = weights.tensor(f"{prefix}hnorm.weight")
        self.eh_proj = weights.linear(f"{prefix}eh_proj")
        self.final_norm = weights.tensor(f"{prefix}shared_head.norm.weight")
        self.block = block
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head

    def __call__(self, ops, input_ids, positions, prev_hidden, kv_cache, step, logits_indices) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] (token p+1 at each position p), prev_hidden [T, hidden] -> (float32 logits
        [len(logits_indices), vocab] for token p+2, y [T, hidden] to chain the next draft from)."""
        embeds = self.embed_tokens[input_ids].masked_fill((positions == 0)[:, None], 0)
        e, _ = ops.rms_norm(embeds, self.enorm, eps=self.eps)
        h, _ = ops.rms_norm(prev_hidden.to(e.dtype).contiguous(), self.hnorm, eps=self.eps)
        x = self.eh_proj(ops, torch.cat((e, h), dim=-1))
        hidden, residual = self.block(ops, x, None, kv_cache, step)
        y = hidden + residual
        normed, _ = ops.rms_norm(y[logits_indices].contiguous(), self.final_norm, eps=self.eps)
        return ops.linear(normed, self.lm_head, fmt="dense").float(), y
