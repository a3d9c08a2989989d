"""DeepSeek-V4.1 causal LM on registry ops: single-pass hyper-connected blocks of CSA2 attention and MoE, Engram.

The residual is `hc_mult` streams per token. Each site (attention, FFN) computes its mixings from the streams
entering it but collapses them with the previous site's `pre` (`hc_pre_delayed`; the first block with the
one-hot); Engram layers add their memory to the streams first. After the last block the streams are collapsed
with the last FFN-site `pre`, normed, and projected to float32 logits (no `hc_head`, unlike V4).

The engine calls `forward(batch, caches)` with the caches `new_caches` made (caches.py: the KV sources' history in
the engine's token blocks, read through each sequence's block table; the rest in one state slot per running
sequence). With the decoder SWA bounded replay (bounded_replay.py) a step's host facts name each sequence's first
decoder position: the encoder layers run on every new token, the decoder layers on the rows from
there on; without them every layer runs on every new token.
"""

from __future__ import annotations

import torch

from deepinfer import exact_order
from deepinfer.model.deepseek_v41 import bounded_replay, decode_plan
from deepinfer.model.deepseek_v41 import caches as v41_caches
from deepinfer.model.deepseek_v41.attention import V41Attention
from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.decode_plan import V41DecodePlan
from deepinfer.model.deepseek_v41.dspark import RESIDUAL, V41DSpark
from deepinfer.model.deepseek_v41.engram import EngramHashing, V41Engram
from deepinfer.model.deepseek_v41.moe import V41MoE
from deepinfer.model.deepseek_v41.roles import LayerRole
from deepinfer.model.deepseek_v41.spans import SharedBatchKV, SharedKV, Span
from deepinfer.model.deepseek_v41.weights import V41Weights
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.hyper_streams import embedded_streams
from deepinfer.ops.rope import rope_cos_sin_cache


def _inverse(table: torch.Tensor) -> torch.Tensor:
    """The table that rotates by the opposite angle (cos, -sin): undoes a rotation."""
    half = table.shape[1] // 2
    return torch.cat((table[:, :half], -table[:, half:]), dim=1)


class V41Block:
    def __init__(self, config: V41Config, role: LayerRole, weights):
        p = f"layers.{role.layer}."
        self.config, self.role = config, role
        self.attn_norm, self.ffn_norm = weights.tensor(f"{p}attn_norm.weight"), weights.tensor(f"{p}ffn_norm.weight")
        self.hc = {site: tuple(weights.tensor(f"{p}hc_{site}_{part}").float() for part in ("fn", "base", "scale")) for site in ("attn", "ffn")}
        self.engram = V41Engram(config, weights, p) if role.engram is not None else None
        self.attn = V41Attention(config, role, weights, f"{p}attn.")
        self.ffn = V41MoE(config, weights, f"{p}ffn.", config.n_routed_experts)

    def _site(self, ops, streams, pre, site: str):
        c = self.config
        fn, base, scale = self.hc[site]
        return ops.hc_pre_delayed(streams, pre, fn, base, scale, norm_eps=c.rms_norm_eps, hc_eps=c.hc_eps, sinkhorn_iters=c.hc_sinkhorn_iters)

    def __call__(self, ops, streams, pre, positions, spans, state, shared, ropes, engram_rows, capture=None):
        """(streams after the block, the FFN site's pre for the next block). spans and shared: the step's spans and each
        one's SharedKV, or a decode step's V41DecodePlan and its SharedBatchKV. capture(streams): called with the
        streams entering the attention site (after Engram): DSpark's target features."""
        eps = self.config.rms_norm_eps
        if self.engram is not None:
            streams = self.engram(ops, streams, engram_rows[self.role.engram])
        if capture is not None:
            capture(streams)
        x, attn_pre, post, comb = self._site(ops, streams, pre, "attn")
        x, _ = ops.rms_norm(x, self.attn_norm, eps=eps)
        if isinstance(spans, V41DecodePlan):  # a decode step planned on the device (decode_plan.py)
            out = self.attn.decode(ops, x, spans, state, shared, ropes)
        else:
            out = self.attn(ops, x, positions, spans, state, shared, ropes)
        streams = ops.hc_post(out, streams, post, comb)
        x, ffn_pre, post, comb = self._site(ops, streams, attn_pre, "ffn")
        x, _ = ops.rms_norm(x, self.ffn_norm, eps=eps)
        return ops.hc_post(self.ffn(ops, x), streams, post, comb), ffn_pre


class DraftFeatures:
    """DSpark's target features of a step's rows: for each target layer, the mean over the hc streams entering its
    attention site (after Engram), side by side [T, targets * hidden]. Rows a bounded replay keeps out of the
    decoder stay zero (a draft reads the last `sliding_window` positions, which the replay's tail covers)."""

    def __init__(self, config: V41Config, tokens: int, dtype: torch.dtype, device):
        self.targets = {layer: i for i, layer in enumerate(config.dspark_target_layer_ids)}
        self.hidden = config.hidden_size
        self.out = torch.zeros(tokens, len(self.targets) * self.hidden, dtype=dtype, device=device)
        self.rows: torch.Tensor | None = None  # the step's rows the layers now run on (None: all)

    def capture(self, layer: V41Block):
        i = self.targets.get(layer.role.layer)
        if i is None:
            return None

        def keep(streams: torch.Tensor) -> None:
            mean = streams.float().mean(dim=1).to(self.out.dtype)  # torch glue: a mean of hc_mult rows, float32 sum
            columns = slice(i * self.hidden, (i + 1) * self.hidden)
            if self.rows is None:
                self.out[:, columns] = mean
            else:
                self.out[self.rows, columns] = mean

        return keep


class DeepseekV41ForCausalLM:
    """`max_positions`: rows of the RoPE tables and of the compressed history, the longest sequence the engine runs.
    `swa_bounded_replay`: whether the engine should prefill the decoder layers on the prompt's tail only
    (`decoder_replay_start`); a step without host facts for it runs every layer on every token either way."""

    supports_device_graphs = True  # a decode step plans its rows on the device (decode_plan.py)
    device_graph_tokens_per_seq = 1  # only decode steps: a prefill, chunk or verification runs the per-span path eagerly

    def __init__(self, config: V41Config, ops, device, dtype: torch.dtype, max_positions: int | None = None, swa_bounded_replay: bool = True):
        self.config, self.ops, self.device, self.dtype = config, ops, torch.device(device), dtype
        self.num_layers = config.num_hidden_layers
        self.swa_bounded_replay = swa_bounded_replay
        self.decoder_start = bounded_replay.decoder_start(config)
        self.max_positions = min(max_positions or config.max_position_embeddings, config.max_position_embeddings)
        rd = config.qk_rope_head_dim
        main = rope_cos_sin_cache(rd, self.max_positions, config.rope_theta).to(self.device)
        scaling = {k: v for k, v in config.compress_rope.items() if k != "rope_theta"} or None
        compress = rope_cos_sin_cache(rd, self.max_positions, config.compress_rope["rope_theta"], scaling).to(self.device)
        self.ropes = {"main": (main, _inverse(main)), "compress": (compress, _inverse(compress))}
        self.placement = self.expert_source = None

    def load_weights(self, weights, token_map: torch.Tensor | None = None, compressed_vocab: int = 0) -> None:
        """weights: `weights.V41Weights`; token_map / compressed_vocab: Engram's (engram_tokens.py), needed when
        the model has Engram layers."""
        c = self.config
        self.embed = weights.tensor("embed.weight")
        self.norm = weights.tensor("norm.weight")
        self.head = (self.embed if c.tie_word_embeddings else weights.tensor("head.weight")).float()
        self.layers = [V41Block(c, role, weights) for role in c.roles]
        self.engram_hashing = EngramHashing(c, token_map, compressed_vocab, self.device) if c.engram_layer_ids else None
        # the DSpark blocks' tensors, built into a drafter only when speculative decoding asks for it (`build_dspark`)
        self.dspark_weights = V41Weights({n: t for n, t in weights.tensors.items() if n.startswith("mtp.")}, weights.dtype)
        self.dspark: V41DSpark | None = None

    def build_dspark(self, confidence_input: str = RESIDUAL) -> V41DSpark:
        """The DSpark drafter of the checkpoint's `mtp.*` blocks (dspark.py); a ValueError when it has none."""
        if not self.config.num_nextn_predict_layers:
            raise ValueError("this DeepSeek-V4.1 checkpoint has no DSpark blocks (text_config.num_nextn_predict_layers is 0)")
        if self.dspark is None or self.dspark.confidence_input != confidence_input:
            self.dspark = V41DSpark(self.config, self.dspark_weights, self.embed, self.head, self.ropes, confidence_input)
        return self.dspark

    # ---- caches --------------------------------------------------------------------------------

    def kv_block_bytes(self, block_size: int, dtype: torch.dtype, draft_layers: int = 0) -> int:
        """Bytes of one token block: the KV sources' stored entries and index keys of its tokens (caches.block_bytes;
        the stored formats are the release's whatever the cache dtype; the DSpark drafter pages nothing). At least
        1: a model without KV sources pages nothing, and the engine divides its budget by this."""
        return max(1, v41_caches.block_bytes(self.config, block_size))

    def state_slot_bytes(self, draft_layers: int = 0, lookahead: int = 0) -> int:
        """A sequence's fixed state in its stored bytes; with `draft_layers` (DSpark drafting), its drafter's context keys too."""
        c = self.config
        context = c.num_nextn_predict_layers * c.sliding_window * c.head_dim * torch.empty((), dtype=self.dtype).element_size() if draft_layers else 0
        return v41_caches.fixed_bytes_per_request(c, lookahead) + context

    def cache_footprint(self) -> tuple[float, int]:
        """(cache bytes one token of history adds: the KV sources' stored entries and index keys, paged; bytes a
        sequence's state slot holds whatever its length: the window rings, an open group's projections, Engram's ids)."""
        return v41_caches.history_bytes_per_token(self.config), v41_caches.fixed_bytes_per_request(self.config)

    def new_draft_caches(self, count: int, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype, lookahead: int = 0) -> list:
        """With `count` (DSpark drafting): one tensor, each sequence's DSpark context keys (`V41DSpark.new_context`)."""
        return [self.build_dspark().new_context(max(1, num_slots), self.dtype, self.device)] if count else []

    @property
    def prefix_replay_tokens(self) -> int:
        """Without state snapshots (a block manager that keeps none) a prefix hit recomputes the whole sequence: its
        history is in the shared blocks (and is not written again), but the fixed state at the hit's end is not."""
        return self.max_positions

    @staticmethod
    def paged_cache_tensors(caches: v41_caches.V41State, draft_caches: list) -> dict[str, torch.Tensor]:
        """Every paged cache tensor by name (dim 0 the block): what a KV tier keeps of a block (deepinfer.kv_tiers): the KV
        sources' compressed entries and index keys. The rest (window rings, open groups, Engram's ids, DSpark's keys)
        is per sequence: a tier keeps it as the state snapshot of the block it was taken at (`prefix_state_tensors`)."""
        out = {}
        for i, layer in enumerate(caches.layers):
            if layer.entries is not None:
                out[f"layers.{i}.entries"] = layer.entries
                out[f"layers.{i}.index_keys"] = layer.index_keys
        return out

    def prefix_state_tensors(self, caches: v41_caches.V41State, draft_caches: list) -> list[torch.Tensor]:
        """Every per-sequence tensor (dim 0: the state slot) a prefix hit restores from a snapshot taken at a block
        boundary (engine/state_snapshots.py): each layer's window ring, each KV source's open-group projections
        (none is open at a boundary: the ratio divides the block size), Engram's last ids, and with DSpark drafting
        its context keys. The history is not among them: it is in the shared blocks."""
        tensors = [t for layer in caches.layers for t in (layer.ring, layer.pending) if t is not None]
        return tensors + ([caches.engram_ids] if caches.engram_ids is not None else []) + list(draft_caches)

    def prefix_hit_limit(self, prompt_tokens: int) -> int:
        """The most positions a prefix hit of a sequence with `prompt_tokens` may cover: with the bounded replay, its
        decoder tail's start (bounded_replay.py), so the hit's prefill computes the decoder rows one prefill would
        (a snapshot's decoder rings hold rows computed for another prompt's tail); else any."""
        if not self.swa_bounded_replay:
            return self.max_positions
        return bounded_replay.decoder_from(self.config, prompt_tokens) if self.decoder_start < self.num_layers else self.max_positions

    def new_caches(self, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype, lookahead: int = 0) -> v41_caches.V41State:
        return v41_caches.allocate(self.config, num_blocks, block_size, max(1, num_slots), self.device, lookahead)

    def decoder_replay_start(self, prompt_tokens: int) -> int:
        """A sequence's first position its decoder layers compute (0: every position; bounded_replay.py)."""
        return bounded_replay.decoder_from(self.config, prompt_tokens) if self.swa_bounded_replay else 0

    # ---- running -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: v41_caches.V41State, *, hidden_states: bool = False):
        """Run one step; returns float32 logits [len(batch.logits_indices), vocab]. With `hidden_states`, also what a
        V4.1 draft reads of every row: DSpark's target features [T, len(dspark_target_layer_ids) * hidden] (`features`),
        zeros on the rows the bounded replay kept out of the decoder layers."""
        ops, c = self.ops, self.config
        if decode_plan.plans_on_device(batch, c):
            return self._decode(batch, caches, hidden_states)
        host = batch.host
        if host is None:
            raise ValueError("a DeepSeek-V4.1 step other than a decode step (one token per sequence, with state slots) needs the batch's host facts")
        spans, offset = [], 0
        for b, (start, length, slot, cached) in enumerate(zip(host.starts, host.lengths, host.slots, host.cached)):
            spans.append(Span(max(slot, 0), start, length, offset, pages=batch.block_tables[b], cached=cached))
            offset += length
        positions = batch.positions
        engram_rows = self.engram_hashing(ops, batch.input_ids, spans, caches.engram_ids) if self.engram_hashing is not None else None
        streams, pre, features = self._entering(batch.input_ids, hidden_states)
        shared = [SharedKV() for _ in spans]
        split = self.decoder_start
        for layer, state in zip(self.layers[:split], caches.layers[:split]):
            streams, pre = layer(ops, streams, pre, positions, spans, state, shared, self.ropes, engram_rows, features.capture(layer) if features else None)
        wanted = batch.logits_indices
        tail = bounded_replay.decoder_tail(spans, shared, host.decoder_from, self.device) if host.decoder_from is not None else None
        if tail is not None:  # the bounded replay: the decoder layers run on each sequence's rows from its decoder_from
            spans, shared = tail.spans, tail.shared
            if tail.rows is not None:
                streams, pre, positions = streams[tail.rows], pre[tail.rows], positions[tail.rows]
                engram_rows = [rows[tail.rows] for rows in engram_rows] if engram_rows is not None else None
                wanted = tail.logits_rows(wanted)
                if features is not None:
                    features.rows = tail.rows
                if not tail.spans:  # a prompt chunk wholly before its tail: no decoder rows, nothing sampled
                    empty = torch.empty(0, self.head.shape[0], dtype=torch.float32, device=self.device)
                    return (empty, features.out) if hidden_states else empty
        for layer, state in zip(self.layers[split:], caches.layers[split:]):
            streams, pre = layer(ops, streams, pre, positions, spans, state, shared, self.ropes, engram_rows, features.capture(layer) if features else None)
        logits = self._logits(ops, streams[wanted], pre[wanted])
        return (logits, features.out) if hidden_states else logits

    __call__ = forward

    def _decode(self, batch: ForwardBatch, caches: v41_caches.V41State, hidden_states: bool):
        """A decode step (one token per sequence) on its device plan: every layer on every token, the whole batch in each
        op, nothing read on the host (what a device graph captures; eager decode runs the same code)."""
        ops, c = self.ops, self.config
        plan = decode_plan.plan_decode(ops, c, batch, caches)
        engram_rows = self.engram_hashing.decode(ops, batch.input_ids, plan, caches.engram_ids) if self.engram_hashing is not None else None
        streams, pre, features = self._entering(batch.input_ids, hidden_states)
        shared = SharedBatchKV()
        for layer, state in zip(self.layers, caches.layers):
            streams, pre = layer(ops, streams, pre, plan.positions, plan, state, shared, self.ropes, engram_rows, features.capture(layer) if features else None)
        wanted = batch.logits_indices
        logits = self._logits(ops, streams[wanted], pre[wanted])
        return (logits, features.out) if hidden_states else logits

    def _entering(self, input_ids: torch.Tensor, hidden_states: bool):
        """(the hc streams entering the first block: each token's embedding hc_mult times, the first site's pre: the
        one-hot, DSpark's target features to fill when `hidden_states`)."""
        streams = embedded_streams(self.embed, input_ids, self.config.hc_mult)
        pre = torch.zeros(streams.shape[:2], dtype=torch.float32, device=self.device)
        pre[:, 0] = 1  # the first site collapses with the one-hot
        features = DraftFeatures(self.config, streams.shape[0], streams.dtype, self.device) if hidden_states else None
        return streams, pre, features

    def _logits(self, ops, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Collapse with the last FFN site's pre (torch glue: once per step, on the sampled rows only; the
        `hc_pre_delayed` collapse without its mixings), the final norm, the float32 vocabulary projection."""
        with exact_order.glue(ops.deterministic):
            hidden = (pre[..., None] * streams.float()).sum(dim=1).to(streams.dtype)
        hidden, _ = ops.rms_norm(hidden, self.norm, eps=self.config.rms_norm_eps)
        return ops.linear(hidden, self.head, fmt="dense", out_dtype=torch.float32)
