"""DeepSeek V2/V3 decoder layers and the causal LM, written only against registry ops.

`DeepseekForCausalLM(config, ops, device, dtype)` is built empty; the loader fills it with
`load_weights`. The engine calls `forward(batch, kv_caches)` with one paged latent cache per layer
(`kv_cache_shape`).
"""

from __future__ import annotations

import torch

from deepinfer.model.attention import MLAttention, StepContext, attention_specs
from deepinfer.model.config import ModelConfig
from deepinfer.model.errors import CheckpointError
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.mlp import DenseMLP, mlp_specs
from deepinfer.model.moe import EXPERT_PROJECTIONS, ExpertPlacement, ExpertSource, MoE, expert_tensor_prefix, moe_specs
from deepinfer.model.mtp import SHARED_COPIES, MTPLayer, mtp_extra_specs
from deepinfer.model.weights import PARAM, TensorSpec, WeightStore
from deepinfer.ops import kv_cache_format
from deepinfer.ops.rope import rope_cos_sin_cache


def model_tensor_specs(config: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor the main model needs (MTP layers aside), by HF name, with its shape and kind."""
    c = config
    specs = {
        "model.embed_tokens.weight": TensorSpec((c.vocab_size, c.hidden_size), PARAM),
        "model.norm.weight": TensorSpec((c.hidden_size,), PARAM),
    }
    if not c.tie_word_embeddings:
        specs["lm_head.weight"] = TensorSpec((c.vocab_size, c.hidden_size), PARAM)
    for layer in range(c.num_hidden_layers):
        specs.update(DecoderLayer.specs(c, layer))
    return specs


def moe_layer_indices(config: ModelConfig) -> list[int]:
    """The decoder layers that are MoE layers, in order (EPLB's maps count these only)."""
    return [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


class DecoderLayer:
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        weights: WeightStore,
        dtype: torch.dtype,
        placement: ExpertPlacement | None = None,
        moe_index: int = 0,
    ):
        prefix = f"model.layers.{layer}."
        self.eps = config.rms_norm_eps
        self.input_norm = weights.tensor(f"{prefix}input_layernorm.weight")
        self.post_attention_norm = weights.tensor(f"{prefix}post_attention_layernorm.weight")
        self.attn = MLAttention(config, weights, f"{prefix}self_attn.", dtype)
        if config.is_moe_layer(layer):
            self.mlp = MoE(config, weights, f"{prefix}mlp.", placement=placement, moe_index=moe_index)
        else:
            self.mlp = DenseMLP(weights, f"{prefix}mlp.")

    @staticmethod
    def specs(config: ModelConfig, layer: int) -> dict[str, TensorSpec]:
        prefix = f"model.layers.{layer}."
        specs = {
            f"{prefix}input_layernorm.weight": TensorSpec((config.hidden_size,), PARAM),
            f"{prefix}post_attention_layernorm.weight": TensorSpec((config.hidden_size,), PARAM),
            **attention_specs(config, f"{prefix}self_attn."),
        }
        if config.is_moe_layer(layer):
            specs.update(moe_specs(config, f"{prefix}mlp."))
        else:
            specs.update(mlp_specs(config.hidden_size, config.intermediate_size, f"{prefix}mlp."))
        return specs

    def __call__(self, ops, hidden, residual, kv_cache, step: StepContext):
        """(hidden, residual) -> (hidden, residual); the residual add is fused into each norm."""
        if residual is None:
            x, _ = ops.rms_norm(hidden, self.input_norm, eps=self.eps)
            residual = hidden
        else:
            x, residual = ops.rms_norm(hidden, self.input_norm, eps=self.eps, residual=residual)
        hidden = self.attn(ops, x, kv_cache, step)
        x, residual = ops.rms_norm(hidden, self.post_attention_norm, eps=self.eps, residual=residual)
        return self.mlp(ops, x), residual


class DeepseekForCausalLM:
    """`placement`: which physical experts of each MoE layer this rank holds (expert parallelism,
    redundant experts); None holds every logical expert once. `max_positions`: rows of the RoPE
    table, the longest sequence the engine will run (None: max_position_embeddings)."""

    def __init__(
        self,
        config: ModelConfig,
        ops,
        device: torch.device | str,
        dtype: torch.dtype,
        placement: ExpertPlacement | None = None,
        max_positions: int | None = None,
    ):
        self.config = config
        self.placement = placement
        self.expert_source: ExpertSource | None = None  # set by the loader: reads experts a new placement needs
        self.ops = ops
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = config.num_hidden_layers
        self.max_positions = min(max_positions or config.max_position_embeddings, config.max_position_embeddings)
        self.cos_sin_cache = rope_cos_sin_cache(config.qk_rope_head_dim, self.max_positions, config.rope_theta, config.rope_scaling).to(self.device)
        self.layers: list[DecoderLayer] = []
        self.embed_tokens: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        # MTP modules (HF: model.layers.{num_hidden_layers + i}.*), kept by name (relative to that
        # prefix, in their kept format); `build_mtp_layers` makes the draft model of them.
        self.mtp_weights: list[dict[str, torch.Tensor]] = []
        self.mtp_layers: list[MTPLayer] = []

    # ---- loading -------------------------------------------------------------------------------

    def tensor_specs(self) -> dict[str, TensorSpec]:
        return model_tensor_specs(self.config)

    def mtp_prefixes(self) -> list[str]:
        c = self.config
        return [f"model.layers.{c.num_hidden_layers + i}." for i in range(c.num_nextn_predict_layers)]

    def load_weights(self, weights: WeightStore) -> None:
        """Build the layers from loaded tensors (already in their kept dtype, on the device)."""
        c = self.config
        self.embed_tokens = weights.tensor("model.embed_tokens.weight")
        self.norm = weights.tensor("model.norm.weight")
        self.lm_head = self.embed_tokens if c.tie_word_embeddings else weights.tensor("lm_head.weight")
        moe_index = {layer: n for n, layer in enumerate(moe_layer_indices(c))}
        self.layers = [DecoderLayer(c, i, weights, self.dtype, self.placement, moe_index.get(i, 0)) for i in range(c.num_hidden_layers)]
        mtp = [weights.take_prefix(p) for p in self.mtp_prefixes()]
        self.mtp_weights = mtp if all(mtp) else []  # empty when the checkpoint ships none (HF's save_pretrained drops them)

    def build_mtp_layers(self) -> list[MTPLayer]:
        """The MTP modules as draft layers (speculative decoding), built once from the kept weights;
        a checkpoint without them, or with some of their tensors missing or misshapen, is a one-line
        CheckpointError naming the problem."""
        if self.mtp_layers:
            return self.mtp_layers
        c = self.config
        if not c.num_nextn_predict_layers or not self.mtp_weights:
            raise CheckpointError(
                f"this checkpoint has no MTP layers (num_nextn_predict_layers={c.num_nextn_predict_layers}, "
                f"{'no' if not self.mtp_weights else len(self.mtp_weights)} MTP tensor sets stored)",
                "speculative decoding with method 'mtp' needs a checkpoint that ships them (DeepSeek-V3/R1, or the embedded tiny-v3)",
            )
        layers = []
        for i, prefix in enumerate(self.mtp_prefixes()):
            layer = c.num_hidden_layers + i
            store = {f"{prefix}{name}": t for name, t in self.mtp_weights[i].items() if name not in SHARED_COPIES}
            specs = {**DecoderLayer.specs(c, layer), **mtp_extra_specs(c, prefix)}
            for name, spec in specs.items():
                if name not in store:
                    raise CheckpointError(
                        f"MTP layer {layer}: tensor {name} (shape {list(spec.shape)}) is missing", "the checkpoint's MTP layers are incomplete"
                    )
                if tuple(store[name].shape) != spec.shape:
                    raise CheckpointError(
                        f"MTP layer {layer}: tensor {name} has shape {list(store[name].shape)}, config.json implies {list(spec.shape)}",
                        "the checkpoint and its config.json disagree",
                    )
            weights = WeightStore(store)
            block = DecoderLayer(c, layer, weights, self.dtype)
            layers.append(MTPLayer(c, weights, prefix, block, self.embed_tokens, self.lm_head))
            if weights.remaining():
                raise CheckpointError(f"MTP layer {layer}: unexpected tensor {weights.remaining()[0]}", "the checkpoint does not match its config.json")
        self.mtp_layers = layers
        return layers

    def skipped_expert_tensors(self, stored_names) -> set[str]:
        """Checkpoint tensors this rank does not load: the experts its placement leaves to others
        (weights and FP8 scales). Empty without a placement."""
        if self.placement is None:
            return set()
        skip = set()
        for n, layer in enumerate(moe_layer_indices(self.config)):
            local = set(self.placement.local_logical(n))
            prefix = f"model.layers.{layer}.mlp."
            for e in range(self.config.n_routed_experts):
                if e not in local:
                    for proj in EXPERT_PROJECTIONS:
                        name = expert_tensor_prefix(prefix, e, proj)
                        skip.update(s for s in (f"{name}.weight", f"{name}.weight_scale_inv") if s in stored_names)
        return skip

    # ---- experts: load counting and placement (EPLB) -------------------------------------------

    @property
    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]

    @property
    def expert_parallels(self) -> list:
        """The distinct ExpertParallel groups of the MoE layers (empty with one rank)."""
        seen = {}
        for moe in self.moe_layers:
            if moe.ep_group is not None:
                seen.setdefault(id(moe.ep_group), moe.ep_group)
        return list(seen.values())

    def _start_forward(self) -> None:
        for group in self.expert_parallels:
            group.start_forward()

    def count_expert_load(self, counts: torch.Tensor | None) -> None:
        """Each MoE layer adds the logical expert ids it routes to row n of counts
        [num_moe_layers, n_routed_experts] (int64, on the model's device); None stops counting."""
        for n, moe in enumerate(self.moe_layers):
            moe.load = None if counts is None else counts[n]

    def set_expert_placement(self, phy2log: torch.Tensor) -> int:
        """Apply a new phy2log [num_moe_layers, P] between steps (every rank of the EP group, the
        same map, at the same step). Returns the number of experts read from the checkpoint."""
        moes = self.moe_layers
        if phy2log.dim() != 2 or phy2log.shape[0] != len(moes):
            raise ValueError(f"phy2log must be [{len(moes)} MoE layers, physical experts], got {tuple(phy2log.shape)}")
        read = sum(moe.set_placement(phy2log[n], self.expert_source) for n, moe in enumerate(moes))
        if self.placement is not None:
            self.placement.phy2log = phy2log.detach().to("cpu", torch.int64).clone()
        return read

    # ---- running -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_idle(self) -> None:
        """A step without tokens on this rank: every MoE layer joins its dispatch / combine
        collectives with an empty batch (expert parallelism with attention data parallelism)."""
        empty = torch.empty(0, self.config.hidden_size, dtype=self.dtype, device=self.device)
        self._start_forward()
        for moe in self.moe_layers:
            moe(self.ops, empty)

    @staticmethod
    def paged_cache_tensors(caches: list[torch.Tensor], draft_caches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every paged cache tensor by name (dim 0 the block): what a KV tier keeps of a block (deepinfer.kv_tiers):
        each layer's latent rows, and the MTP layer's when speculative decoding runs."""
        return {**{f"layers.{i}": t for i, t in enumerate(caches)}, **{f"mtp.{i}": t for i, t in enumerate(draft_caches)}}

    def kv_cache_shape(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> tuple[int, int, int]:
        """One layer's paged latent cache in `dtype` (default the model's): [num_blocks, block_size,
        kv_lora_rank + qk_rope_head_dim], 4 more for an FP8 cache's per-token scale."""
        return (num_blocks, block_size, kv_cache_format.row_width(self.config.kv_cache_width, dtype or self.dtype))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor], *, hidden_states: bool = False):
        """Run one step; returns float32 logits [len(batch.logits_indices), vocab], and with
        `hidden_states` also every new token's final hidden state [T, hidden] (after the final norm:
        what the MTP draft layers read)."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"forward needs {self.num_layers} KV caches (one per layer), got {len(kv_caches)}")
        ops = self.ops
        self._start_forward()
        step = self._step_context(batch, block_size=kv_caches[0].shape[1])
        hidden = self.embed_tokens[batch.input_ids]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(ops, hidden, residual, kv_cache, step)
        if hidden_states:
            hidden, _ = ops.rms_norm(hidden, self.norm, eps=self.config.rms_norm_eps, residual=residual)
            return ops.linear(hidden[batch.logits_indices], self.lm_head, fmt="dense").float(), hidden
        hidden = hidden[batch.logits_indices]
        residual = residual[batch.logits_indices]
        hidden, _ = ops.rms_norm(hidden, self.norm, eps=self.config.rms_norm_eps, residual=residual)
        return ops.linear(hidden, self.lm_head, fmt="dense").float()

    __call__ = forward

    @torch.inference_mode()
    def forward_mtp(self, index: int, batch: ForwardBatch, prev_hidden: torch.Tensor, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP module `index` over a step: batch.input_ids hold token p+1 for each position p;
        returns (float32 logits at batch.logits_indices, the layer's output to chain from)."""
        layer = self.build_mtp_layers()[index]
        step = self._step_context(batch, block_size=kv_cache.shape[1])
        return layer(self.ops, batch.input_ids, batch.positions, prev_hidden, kv_cache, step, batch.logits_indices)

    def _step_context(self, batch: ForwardBatch, block_size: int) -> StepContext:
        step = StepContext(
            positions=batch.positions,
            cos_sin_cache=self.cos_sin_cache,
            is_prefill=batch.is_prefill,
            slot_mapping=batch.slot_mapping,
            cu_seqlens_q=batch.cu_seqlens_q,
            seq_lens=batch.seq_lens,
            block_tables=batch.block_tables,
        )
        num_seqs, num_tokens = batch.num_seqs, int(batch.input_ids.shape[0])
        if batch.is_prefill:
            step.context_slots, step.cu_seqlens_k = _context_slots(batch.seq_lens, batch.block_tables, block_size)
        elif batch.host is not None and len(set(batch.host.lengths)) > 1:
            step.decode_groups = _decode_groups(batch.host.lengths, batch.positions.device)
        else:
            if num_seqs == 0 or num_tokens % num_seqs:
                raise ValueError(f"a decode step needs the same number of new tokens per sequence: {num_tokens} tokens, {num_seqs} sequences")
            step.decode_shape = (num_seqs, num_tokens // num_seqs)
        return step


def _decode_groups(lengths: list[int], device: torch.device) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """A decode step whose sequences bring different numbers of new tokens (speculative
    verification): per distinct count S, (S, the sequences' indices, their tokens' rows)."""
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    groups = []
    for size in sorted(set(lengths)):
        seqs = [b for b, n in enumerate(lengths) if n == size]
        rows = [starts[b] + i for b in seqs for i in range(size)]
        groups.append((size, torch.tensor(seqs, dtype=torch.int64).to(device), torch.tensor(rows, dtype=torch.int64).to(device)))
    return groups


def _context_slots(seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots of every sequence's tokens 0..seq_len-1, concatenated, and their prefix sums [B+1] int32."""
    lens = seq_lens.long()
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0))
    total = int(cu[-1])  # one host sync per step: the context length sizes the gathered K/V
    seq_of_token = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=total)
    index_in_seq = torch.arange(total, device=lens.device) - cu[:-1][seq_of_token]
    pages = block_tables[seq_of_token, index_in_seq // block_size].long()
    return pages * block_size + index_in_seq % block_size, cu.to(torch.int32)
