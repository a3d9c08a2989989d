"""DeepSeek-V4's MTP block (`mtp.N.*`): the draft layer speculative decoding chains.

As DeepSeek's inference code defines it, for token p+1 at position p and the target's residual
streams h [T, hc_mult, hidden] at p (before the head's collapse):

    e = enorm(embed(token p+1));  x = e_proj(e) broadcast over the streams + h_proj(hnorm(h))
    x = a full V4 decoder block (attention, MoE, hyper-connections) as layer num_hidden_layers
    logits = head(norm(hc_head(x)))   with the block's own hc_head fn / base / scale

The embedding and the vocabulary projection are the target's. The block's attention type and MoE
type are read from the tensors it ships (an indexer: CSA; a compressor alone: HCA; neither: sliding
window only; `gate.tid2eid`: hash routing), so its cache is allocated like a main layer of that type.
As for V3 (deepinfer.model.mtp), position 0 has no previous token: its embedding input is zero.
"""

from __future__ import annotations

import dataclasses

import torch

from deepinfer.model.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, V4Config
from deepinfer.model.weights import FLOAT32, LINEAR, TensorSpec, WeightStore


def mtp_prefix(index: int) -> str:
    return f"mtp.{index}."


def mtp_prefixes(config: V4Config) -> list[str]:
    return [mtp_prefix(i) for i in range(config.num_nextn_predict_layers)]


def mtp_kinds(names, index: int = 0) -> tuple[str, str]:
    """(attention type, MoE type) of MTP block `index`, read from its tensors (`names`: every
    stored tensor name): an indexer means CSA, a compressor alone HCA, neither a sliding window;
    `gate.tid2eid` means hash routing."""
    prefix = mtp_prefix(index)
    ours = {n[len(prefix) :] for n in names if n.startswith(prefix)}
    if any(n.startswith("attn.indexer.") for n in ours):
        kind = CSA
    elif any(n.startswith("attn.compressor.") for n in ours):
        kind = HCA
    else:
        kind = SLIDING
    return kind, HASH_MOE if "ffn.gate.tid2eid" in ours else MOE


def mtp_config(config: V4Config, kinds: tuple[str, str], index: int = 0) -> V4Config:
    """The config the MTP block is built with: one more layer (index num_hidden_layers + index) of
    the block's types (`mtp_kinds`)."""
    kind, mlp = kinds
    return dataclasses.replace(
        config,
        num_hidden_layers=config.num_hidden_layers + index + 1,
        layer_types=config.layer_types + (SLIDING,) * index + (kind,),
        mlp_layer_types=config.mlp_layer_types + (MOE,) * index + (mlp,),
    )


def mtp_tensor_specs(config: V4Config, kinds: tuple[str, str], index: int = 0) -> dict[str, TensorSpec]:
    """MTP block `index`'s tensors, for a block of these types: a decoder layer's, its input
    projections and norms, and a head's own collapse and norm."""
    from deepinfer.model.deepseek_v4.model import decoder_layer_specs, head_specs

    prefix = mtp_prefix(index)
    c = mtp_config(config, kinds, index)
    hidden = c.hidden_size
    return {
        f"{prefix}enorm.weight": TensorSpec((hidden,), FLOAT32),
        f"{prefix}hnorm.weight": TensorSpec((hidden,), FLOAT32),
        f"{prefix}e_proj.weight": TensorSpec((hidden, hidden), LINEAR),
        f"{prefix}h_proj.weight": TensorSpec((hidden, hidden), LINEAR),
        **head_specs(c, prefix),
        **decoder_layer_specs(c, c.num_hidden_layers - 1, prefix),
    }


class V4MTPLayer:
    def __init__(self, config: V4Config, weights: WeightStore, index: int, dtype: torch.dtype):
        """config: `mtp_config`'s (the block is its last layer)."""
        from deepinfer.model.deepseek_v4.model import V4DecoderLayer

        p = mtp_prefix(index)
        self.config = config
        self.layer = config.num_hidden_layers - 1
        self.enorm = weights.tensor(f"{p}enorm.weight")
        self.hnorm = weights.tensor(f"{p}hnorm.weight")
        self.norm = weights.tensor(f"{p}norm.weight")
        self.e_proj = weights.linear(f"{p}e_proj")
        self.h_proj = weights.linear(f"{p}h_proj")
        self.hc_head = tuple(weights.tensor(f"{p}hc_head_{part}") for part in ("fn", "base", "scale"))
        self.block = V4DecoderLayer(config, self.layer, weights, dtype, prefix=p)

    def __call__(self, ops, embed: torch.Tensor, input_ids, positions, prev_streams, cache, step, ropes) -> torch.Tensor:
        """input_ids [T] (token p+1 at each position p), prev_streams [T, hc_mult, hidden] (the
        target's, or the previous draft's block output) -> the block's output streams [T, hc_mult, hidden]."""
        c = self.config
        tokens, streams, hidden = prev_streams.shape
        e = embed[input_ids].masked_fill((positions == 0)[:, None], 0)
        e, _ = ops.rms_norm(e, self.enorm, eps=c.rms_norm_eps)
        h, _ = ops.rms_norm(prev_streams.reshape(tokens * streams, hidden).to(e.dtype).contiguous(), self.hnorm, eps=c.rms_norm_eps)
        x = self.h_proj(ops, h).view(tokens, streams, hidden) + self.e_proj(ops, e)[:, None, :]
        return self.block(ops, x.contiguous(), cache, step, ropes, input_ids)
