"""DeepSeek-V4.1's DSpark drafter (`mtp.0..S-1`): a parallel block drafter over the target's features.

Not V3's chained MTP. At an anchor position a (the newest token, whose target features do not exist yet):
- context: for the target layers (`dspark_target_layer_ids`), the mean of the hc streams entering each one's
  attention site, side by side (model.DraftFeatures), at positions a - window .. a - 1, projected once
  (`mtp.0.main_proj`, `main_norm`); each stage keys them with its own `kv_norm(wkv .)`, rotated, FP8-rounded
  (kept per request by the engine: `context_kv`, the slot's ring of `new_context`);
- block: the embeddings of [token a, noise x (block - 1)] at positions a .. a + block - 1 as hc streams, through
  the S stages (single-pass mHC, SWA-only attention over the context window and every row of its own block,
  bidirectionally, plus the sink; a MoE of `dspark_n_routed_experts` routed top `dspark_num_experts_per_tok`);
- heads: h_k = the last stage's streams collapsed with its FFN-site pre; logits_k = head(norm(h_k)) +
  markov(x_{k-1}) with markov(x) = markov_head.head(markov_head.embed(x)), x_{-1} the anchor and x_k the token
  drafted for slot k (drafted in order: the Markov bias is the only thing that depends on the slot before);
  slot k proposes the token at a + k + 1. The confidence head gives c_k = sigmoid(proj [h_k ; embed(x_{k-1})]),
  the probability that draft k is accepted given the ones before it were: the released model reads the
  pre-norm h_k, NeMo Automodel's own trained drafts the normed one (`confidence_input`).
The embedding and the vocabulary head are the target's. The oracle is NeMo Automodel 0.7.0's `dspark.py`.
"""

from __future__ import annotations

import torch

from deepinfer import exact_order
from deepinfer.model.deepseek_v41.attention import V41Attention
from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.moe import V41MoE
from deepinfer.model.deepseek_v41.roles import SWA, LayerRole
from deepinfer.model.deepseek_v41.spans import rotate_tail
from deepinfer.model.hyper_streams import embedded_streams

RESIDUAL, NORMED = "residual", "normed"  # what the confidence head reads: the release's raw h_k, or norm(h_k)


class DSparkStage:
    """One draft block `mtp.s.`: a V4.1 block with SWA-only attention over the context and its own draft block."""

    def __init__(self, config: V41Config, stage: int, weights):
        p = f"mtp.{stage}."
        self.config = config
        role = LayerRole(config.num_hidden_layers + stage, 0, SWA, None, None, False, None)
        self.attn = V41Attention(config, role, weights, f"{p}attn.")
        self.attn_norm, self.ffn_norm = weights.tensor(f"{p}attn_norm.weight"), weights.tensor(f"{p}ffn_norm.weight")
        self.hc = {site: tuple(weights.tensor(f"{p}hc_{site}_{part}").float() for part in ("fn", "base", "scale")) for site in ("attn", "ffn")}
        self.ffn = V41MoE(config, weights, f"{p}ffn.", config.dspark_n_routed_experts, top_k=config.dspark_num_experts_per_tok)

    def _site(self, ops, streams, pre, site: str):
        c = self.config
        fn, base, scale = self.hc[site]
        return ops.hc_pre_delayed(streams, pre, fn, base, scale, norm_eps=c.rms_norm_eps, hc_eps=c.hc_eps, sinkhorn_iters=c.hc_sinkhorn_iters)

    def __call__(self, ops, streams, pre, positions, context: torch.Tensor, rows: torch.Tensor, ropes: dict):
        """streams [N, hc, hidden] of the step's block rows at `positions`; context [M, head_dim] the blocks'
        context keys; rows [N, W] int32: each block row's keys, as rows of cat(context, the block rows' own
        keys), -1 for none. Returns (streams, the FFN site's pre)."""
        eps = self.config.rms_norm_eps
        cos_sin, inverse = ropes["main"]  # compress ratio 0: the plain RoPE
        x, attn_pre, post, comb = self._site(ops, streams, pre, "attn")
        x, _ = ops.rms_norm(x, self.attn_norm, eps=eps)
        attn = self.attn
        _, q = attn.queries(ops, x, positions, cos_sin)
        keys = torch.cat((context, attn.window_kv(ops, x, positions, cos_sin)))
        out = ops.sparse_attention(q, keys, rows, attn.sinks, softmax_scale=attn.dim**-0.5)
        out = attn.project(ops, rotate_tail(ops, out, attn.rope_dim, positions, inverse))
        streams = ops.hc_post(out, streams, post, comb)
        x, ffn_pre, post, comb = self._site(ops, streams, attn_pre, "ffn")
        x, _ = ops.rms_norm(x, self.ffn_norm, eps=eps)
        return ops.hc_post(self.ffn(ops, x), streams, post, comb), ffn_pre

    def context_kv(self, ops, projected: torch.Tensor, positions: torch.Tensor, ropes: dict) -> torch.Tensor:
        """This stage's keys (= values) of projected target features [T, hidden] at `positions` -> [T, head_dim]."""
        return self.attn.window_kv(ops, projected, positions, ropes["main"][0])


class V41DSpark:
    def __init__(self, config: V41Config, weights, embed: torch.Tensor, head: torch.Tensor, ropes: dict, confidence_input: str = RESIDUAL):
        """embed, head: the target's embedding and float32 vocabulary projection; ropes: the target's tables."""
        if confidence_input not in (RESIDUAL, NORMED):
            raise ValueError(f"confidence_input must be {RESIDUAL!r} or {NORMED!r}, got {confidence_input!r}")
        c = self.config = config
        self.stages = [DSparkStage(c, s, weights) for s in range(c.num_nextn_predict_layers)]
        self.main_proj = weights.linear("mtp.0.main_proj")
        self.main_norm = weights.tensor("mtp.0.main_norm.weight")
        last = f"mtp.{c.num_nextn_predict_layers - 1}."
        self.norm = weights.tensor(f"{last}norm.weight")
        self.markov_embed = weights.tensor(f"{last}markov_head.embed.weight")
        self.markov_head = weights.tensor(f"{last}markov_head.head.weight")
        self.confidence_proj = weights.tensor(f"{last}confidence_head.proj.weight").float()  # the release keeps it float32
        self.embed, self.head, self.ropes = embed, head, ropes
        self.confidence_input = confidence_input
        self.block_size, self.window = c.dspark_block_size, c.sliding_window

    def new_context(self, slots: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Each request's context keys: [slots, stages, window, head_dim], position p in row p % window."""
        return torch.zeros(slots, len(self.stages), self.window, self.config.head_dim, dtype=dtype, device=device)

    def context_kv(self, ops, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Every stage's context keys of target features [T, targets * hidden] at `positions` -> [stages, T, head_dim]."""
        projected, _ = ops.rms_norm(self.main_proj(ops, features), self.main_norm, eps=self.config.rms_norm_eps)
        return torch.stack([stage.context_kv(ops, projected, positions, self.ropes) for stage in self.stages])

    def hidden(self, ops, anchors: torch.Tensor, anchor_positions: torch.Tensor, context: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The last stage's collapsed rows h [B, block, hidden] of B blocks: anchors [B] (token ids) at
        anchor_positions [B]; context [stages, B, window, head_dim] each block's context keys of positions
        a - window .. a - 1; visible [B, window] bool: those that exist (position >= 0)."""
        c = self.config
        blocks, k = anchors.shape[0], self.block_size
        device = anchors.device
        ids = torch.full((blocks, k), c.dspark_noise_token_id, dtype=torch.int64, device=device)
        ids[:, 0] = anchors
        positions = (anchor_positions[:, None] + torch.arange(k, device=device)).flatten()
        streams = embedded_streams(self.embed, ids.flatten(), c.hc_mult)
        pre = torch.zeros(streams.shape[:2], dtype=torch.float32, device=device)
        pre[:, 0] = 1  # the first site collapses with the one-hot
        window = self.window
        # block b's rows list its context rows b*W .. b*W + W - 1 (those visible), then its own block's rows
        context_rows = torch.arange(blocks * window, device=device).view(blocks, window)
        context_rows = torch.where(visible, context_rows, -1)
        own = blocks * window + torch.arange(blocks * k, device=device).view(blocks, k)
        rows = torch.cat((context_rows, own), dim=1).repeat_interleave(k, dim=0).to(torch.int32)
        for stage, keys in zip(self.stages, context):
            streams, pre = stage(ops, streams, pre, positions, keys.reshape(blocks * window, -1), rows, self.ropes)
        with exact_order.glue(ops.deterministic):  # the collapse with the last FFN site's pre (as the target's head)
            h = (pre[..., None] * streams.float()).sum(dim=1).to(streams.dtype)
        return h.view(blocks, k, -1)

    def draft(self, ops, h: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [B, block] int64, confidences [B, block] float32, logits [B, block, vocab] float32) of the rows
        h [B, block, hidden]: slot by slot, each conditioned through the Markov bias on the token before it."""
        blocks, k, hidden = h.shape
        normed, _ = ops.rms_norm(h.reshape(blocks * k, hidden), self.norm, eps=self.config.rms_norm_eps)
        base = ops.linear(normed, self.head, fmt="dense", out_dtype=torch.float32).view(blocks, k, -1)
        reads = (normed if self.confidence_input == NORMED else h.reshape(blocks * k, hidden)).view(blocks, k, hidden)
        previous, tokens, confidences, logits = anchors, [], [], []
        for slot in range(k):
            embedding = self.markov_embed[previous]  # a gather (torch glue, as the target's embedding)
            slot_logits = base[:, slot] + ops.linear(embedding, self.markov_head, fmt="dense").float()
            previous = slot_logits.argmax(dim=-1)  # greedy drafts: the verification rule for point-mass drafts
            joined = torch.cat((reads[:, slot].float(), embedding.float()), dim=-1)
            confidences.append(torch.sigmoid(ops.linear(joined, self.confidence_proj, fmt="dense")[:, 0]))
            tokens.append(previous)
            logits.append(slot_logits)
        return torch.stack(tokens, dim=1), torch.stack(confidences, dim=1), torch.stack(logits, dim=1)
