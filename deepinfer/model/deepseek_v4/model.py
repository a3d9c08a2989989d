"""DeepSeek-V4 causal LM: hyper-connected decoder layers of V4 attention and V4 MoE, on registry ops.

The residual is `hc_mult` streams per token; each block reads them through `hc_pre` and writes back
through `hc_post`; the head collapses them once (`hc_head`) before the final norm. Built empty, filled
by `load_weights`; the engine calls `forward(batch, caches)` with the caches `new_caches` made.
"""

from __future__ import annotations

import torch

from deepinfer.model.deepseek_v4 import caches as v4_caches
from deepinfer.model.deepseek_v4.attention import V4Attention, attention_specs
from deepinfer.model.deepseek_v4.config import V4Config
from deepinfer.model.deepseek_v4.decode_plan import plan_decode
from deepinfer.model.deepseek_v4.moe import V4MoE, moe_specs
from deepinfer.model.deepseek_v4.mtp import V4MTPLayer, mtp_config, mtp_prefixes
from deepinfer.model.deepseek_v4.step import SeqStep, plan_step
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.hyper_streams import embedded_streams
from deepinfer.model.weights import FLOAT32, PARAM, TensorSpec, WeightStore
from deepinfer.ops.rope import rope_cos_sin_cache


def model_tensor_specs(config: V4Config) -> dict[str, TensorSpec]:
    """Every tensor of the main model (MTP layers aside), by DeepSeek's name, with shape and kind."""
    c = config
    hidden = c.hidden_size
    specs = {"embed.weight": TensorSpec((c.vocab_size, hidden), PARAM), **head_specs(c, "")}
    if not c.tie_word_embeddings:
        specs["head.weight"] = TensorSpec((c.vocab_size, hidden), PARAM)
    for layer in range(c.num_hidden_layers):
        specs.update(decoder_layer_specs(c, layer, f"layers.{layer}."))
    return specs


def head_specs(config: V4Config, prefix: str) -> dict[str, TensorSpec]:
    """A head's own tensors (the main model's, an MTP block's): the streams' collapse and the final norm."""
    n, hidden = config.hc_mult, config.hidden_size
    return {
        f"{prefix}norm.weight": TensorSpec((hidden,), FLOAT32),
        f"{prefix}hc_head_fn": TensorSpec((n, n * hidden), FLOAT32),
        f"{prefix}hc_head_base": TensorSpec((n,), FLOAT32),
        f"{prefix}hc_head_scale": TensorSpec((1,), FLOAT32),
    }


def decoder_layer_specs(config: V4Config, layer: int, prefix: str) -> dict[str, TensorSpec]:
    """One decoder layer's tensors (its norms, hyper-connection mixes, attention and MoE) under `prefix`."""
    c = config
    n, hidden = c.hc_mult, c.hidden_size
    mix = (2 + n) * n
    specs = {f"{prefix}attn_norm.weight": TensorSpec((hidden,), FLOAT32), f"{prefix}ffn_norm.weight": TensorSpec((hidden,), FLOAT32)}
    for block in ("attn", "ffn"):
        specs[f"{prefix}hc_{block}_fn"] = TensorSpec((mix, n * hidden), FLOAT32)
        specs[f"{prefix}hc_{block}_base"] = TensorSpec((mix,), FLOAT32)
        specs[f"{prefix}hc_{block}_scale"] = TensorSpec((3,), FLOAT32)
    specs.update(attention_specs(c, layer, f"{prefix}attn."))
    specs.update(moe_specs(c, layer, f"{prefix}ffn."))
    return specs


class V4DecoderLayer:
    def __init__(self, config: V4Config, layer: int, weights: WeightStore, dtype: torch.dtype, prefix: str | None = None):
        """prefix: the layer's tensors' (default `layers.<layer>.`; the MTP block's `mtp.N.`)."""
        p = prefix or f"layers.{layer}."
        self.config = config
        self.attn_norm = weights.tensor(f"{p}attn_norm.weight")
        self.ffn_norm = weights.tensor(f"{p}ffn_norm.weight")
        self.hc = {block: tuple(weights.tensor(f"{p}hc_{block}_{part}") for part in ("fn", "base", "scale")) for block in ("attn", "ffn")}
        self.attn = V4Attention(config, layer, weights, f"{p}attn.", dtype)
        self.ffn = V4MoE(config, layer, weights, f"{p}ffn.")

    def _pre(self, ops, streams: torch.Tensor, block: str, norm: torch.Tensor):
        """The block's input, already normed with its RMSNorm `norm` (hc_pre's option: one launch), and the mixings."""
        c = self.config
        fn, base, scale = self.hc[block]
        return ops.hc_pre(streams, fn, base, scale, norm_eps=c.rms_norm_eps, hc_eps=c.hc_eps, sinkhorn_iters=c.hc_sinkhorn_iters, norm_weight=norm)

    def __call__(self, ops, streams: torch.Tensor, cache, step, ropes, input_ids: torch.Tensor) -> torch.Tensor:
        x, post, comb = self._pre(ops, streams, "attn", self.attn_norm)
        streams = ops.hc_post(self.attn(ops, x, cache, step, ropes), streams, post, comb)
        x, post, comb = self._pre(ops, streams, "ffn", self.ffn_norm)
        return ops.hc_post(self.ffn(ops, x, input_ids), streams, post, comb)


def plans_on_device(batch: ForwardBatch) -> bool:
    """Whether a step's plan is built on the device (decode_plan): a decode step, every sequence one token, with
    its state slots, none of whose tokens is replayed (a replayed token's KV is already paged, which only the
    host knows; a device graph's batch has no host facts and is always a decode step)."""
    if batch.is_prefill or batch.max_query_len != 1 or batch.state_slots is None or batch.input_ids.shape[0] != batch.num_seqs:
        return False
    host = batch.host
    return host is None or all(cached <= start for cached, start in zip(host.cached, host.starts))


def _inverse(table: torch.Tensor) -> torch.Tensor:
    """The table that rotates by the opposite angle (cos, -sin): undoes a rotation."""
    half = table.shape[1] // 2
    return torch.cat((table[:, :half], -table[:, half:]), dim=1)


class DeepseekV4ForCausalLM:
    """`max_positions`: rows of the RoPE tables, the longest sequence the engine will run."""

    supports_device_graphs = True  # a decode step plans its cache rows on the device (decode_plan)
    device_graph_tokens_per_seq = 1  # only decode steps: a verification step's rows are planned on the host (step.py)

    def __init__(self, config: V4Config, ops, device, dtype: torch.dtype, max_positions: int | None = None):
        self.config = config
        self.ops = ops
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = config.num_hidden_layers
        self.max_positions = min(max_positions or config.max_position_embeddings, config.max_position_embeddings)
        rd = config.qk_rope_head_dim
        main = rope_cos_sin_cache(rd, self.max_positions, config.rope_theta).to(self.device)
        compress_scaling = {k: v for k, v in config.compress_rope.items() if k != "rope_theta"} or None
        compress = rope_cos_sin_cache(rd, self.max_positions, config.compress_rope["rope_theta"], compress_scaling).to(self.device)
        self.ropes = {"main": (main, _inverse(main)), "compress": (compress, _inverse(compress))}
        self.layers: list[V4DecoderLayer] = []
        self.mtp_layers: list[V4MTPLayer] = []
        self.mtp_problem: str | None = None
        self.placement = None  # no expert parallelism for V4 yet
        self.expert_source = None

    # ---- loading -------------------------------------------------------------------------------

    def tensor_specs(self) -> dict[str, TensorSpec]:
        return model_tensor_specs(self.config)

    def load_weights(self, weights: WeightStore, mtp_blocks: dict[int, tuple[str, str]] | None = None) -> None:
        """mtp_blocks: the MTP blocks whose tensors were all loaded, index -> their types
        (`mtp.mtp_kinds`). Any other `mtp.*` tensor is dropped, and the MTP blocks are then not
        offered as a drafter (`build_mtp_layers` says why)."""
        c = self.config
        self.embed = weights.tensor("embed.weight")
        self.norm = weights.tensor("norm.weight")
        self.head = self.embed if c.tie_word_embeddings else weights.tensor("head.weight")
        self.hc_head = tuple(weights.tensor(f"hc_head_{part}") for part in ("fn", "base", "scale"))
        self.layers = [V4DecoderLayer(c, i, weights, self.dtype) for i in range(c.num_hidden_layers)]
        self.mtp_layers = [V4MTPLayer(mtp_config(c, kinds, i), weights, i, self.dtype) for i, kinds in sorted((mtp_blocks or {}).items())]
        leftover = sorted(p + rest for p in mtp_prefixes(c) for rest in weights.take_prefix(p))
        if leftover:
            self.mtp_problem = f"its MTP tensors are not the V4 block layout deepinfer knows (e.g. {leftover[0]})"
            self.mtp_layers = []

    def build_mtp_layers(self) -> list[V4MTPLayer]:
        """The checkpoint's MTP blocks (speculative decoding's drafter); a one-line error without them."""
        if not self.mtp_layers:
            from deepinfer.model.errors import CheckpointError

            problem = self.mtp_problem or "it has no MTP layers (mtp.0.* tensors)"
            fix = "drop speculative, or use a checkpoint that ships its MTP layers"
            raise CheckpointError(f"the checkpoint cannot draft for speculative decoding: {problem}", fix)
        return self.mtp_layers

    def skipped_expert_tensors(self, stored_names) -> set[str]:
        return set()

    # ---- caches --------------------------------------------------------------------------------

    def kv_block_bytes(self, block_size: int, dtype: torch.dtype, draft_layers: int = 0) -> int:
        """Bytes per token block over every layer's paged caches, and over `draft_layers` MTP blocks."""
        return v4_caches.block_bytes(self.config, block_size, dtype) + sum(
            v4_caches.block_bytes(m.config, block_size, dtype, first=m.layer) for m in self.mtp_layers[:draft_layers])

    def state_slot_bytes(self, draft_layers: int = 0, lookahead: int = 0) -> int:
        """Bytes per state slot (the compressors' rings, `lookahead` rows longer: `caches.ring_size`), MTP blocks' included."""
        return v4_caches.slot_bytes(self.config, lookahead=lookahead) + sum(
            v4_caches.slot_bytes(m.config, first=m.layer, lookahead=lookahead) for m in self.mtp_layers[:draft_layers])

    @property
    def prefix_replay_tokens(self) -> int:
        return self.config.prefix_replay_tokens

    @staticmethod
    def paged_cache_tensors(caches: list, draft_caches: list) -> dict[str, torch.Tensor]:
        """Every paged cache tensor by name (dim 0 the block): what a KV tier keeps of a block (deepinfer.kv_tiers):
        each layer's sliding-window rows, its compressor's entries and its indexer's keys (v4_caches). The
        compressors' rings are per sequence, not paged: a restored prefix rebuilds them by the bounded replay."""
        out = {}
        for prefix, layer_caches in (("layers", caches), ("mtp", draft_caches)):
            for i, cache in enumerate(layer_caches):
                out[f"{prefix}.{i}.swa"] = cache.swa
                if cache.compressor is not None:
                    out[f"{prefix}.{i}.compressed"] = cache.compressor.pool
                if cache.indexer is not None:
                    out[f"{prefix}.{i}.index_keys"] = cache.indexer.pool
        return out

    def new_caches(self, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype, lookahead: int = 0) -> list:
        """lookahead: the most positions a step writes past a sequence's last accepted token (speculative
        decoding's drafts): the compressors' rings grow by as many rows (`caches.ring_size`)."""
        for ratio in self.config.ratios:
            v4_caches.rows_per_block(block_size, ratio)  # the block size must suit every ratio
        return v4_caches.allocate(self.config, num_blocks, block_size, num_slots, dtype, self.device, lookahead=lookahead)

    def new_draft_caches(self, count: int, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype, lookahead: int = 0) -> list:
        """The first `count` MTP blocks' caches, laid out as a main layer of their type."""
        return [v4_caches.allocate(m.config, num_blocks, block_size, num_slots, dtype, self.device, first=m.layer, lookahead=lookahead)[0]
                for m in self.mtp_layers[:count]]  # fmt: skip

    # ---- running -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: list, *, hidden_states: bool = False):
        """Run one step; returns float32 logits [len(batch.logits_indices), vocab], and with
        `hidden_states` also every new token's residual streams [T, hc_mult, hidden] before the head
        (what the MTP block reads)."""
        if len(caches) != self.num_layers:
            raise ValueError(f"forward needs {self.num_layers} layer caches, got {len(caches)}")
        ops, c = self.ops, self.config
        step = self.step_plan(c, batch, caches)
        streams = embedded_streams(self.embed, batch.input_ids, c.hc_mult)
        for layer, cache in zip(self.layers, caches):
            streams = layer(ops, streams, cache, step, self.ropes, batch.input_ids)
        logits = self._logits(ops, streams[batch.logits_indices], self.hc_head, self.norm)
        return (logits, streams) if hidden_states else logits

    __call__ = forward

    @torch.inference_mode()
    def forward_mtp(self, index: int, batch: ForwardBatch, prev_hidden: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP block `index` over a step: batch.input_ids hold token p+1 for each position p,
        prev_hidden the streams at p; returns (float32 logits at batch.logits_indices, the block's
        output streams to chain from)."""
        layer = self.build_mtp_layers()[index]
        step = self.step_plan(layer.config, batch, [cache])
        streams = layer(self.ops, self.embed, batch.input_ids, step.positions, prev_hidden, cache, step, self.ropes)
        return self._logits(self.ops, streams[batch.logits_indices], layer.hc_head, layer.norm), streams

    def step_plan(self, config: V4Config, batch: ForwardBatch, caches: list):
        """The step's cache rows, for caches laid out by `new_caches`: a decode step's planned on the device
        (decode_plan: what a device graph captures), any other step's on the host (step.py)."""
        rings = {(c.ratio, c.overlap): c.ring for cache in caches for c in (cache.compressor, cache.indexer) if c is not None}
        block_size = caches[0].swa.shape[1]
        if plans_on_device(batch):  # the plan's op fills group_rows too
            return plan_decode(self.ops, config, batch.positions, batch.block_tables, batch.slot_mapping, batch.state_slots, block_size, rings)
        host = batch.host
        if host is None:
            raise ValueError("a DeepSeek-V4 step other than a decode step (one token per sequence, with state slots) needs the batch's host facts")
        seqs = [SeqStep(start, length, cached, slot, pages) for start, length, cached, slot, pages in
                zip(host.starts, host.lengths, host.cached, host.slots, host.pages)]  # fmt: skip
        step = plan_step(config, seqs, block_size, self.device, rings=rings, upload=host.upload)
        # once per step, not per layer: every layer's grouped output projection reads it
        step.group_rows = torch.full((config.o_groups,), step.positions.shape[0], dtype=torch.int32, device=self.device)
        return step

    def _logits(self, ops, streams: torch.Tensor, hc_head, norm) -> torch.Tensor:
        """Collapse the streams with a head's own mixing and apply its final norm (`hc_head`: one op, on the
        sampled rows only), then the vocabulary projection."""
        c = self.config
        fn, base, scale = hc_head
        hidden = ops.hc_head(streams, fn, base, scale, norm, norm_eps=c.rms_norm_eps, hc_eps=c.hc_eps)
        return ops.linear(hidden, self.head, fmt="dense").float()
