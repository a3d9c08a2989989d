"""The tensors of a DeepSeek-V4.1 checkpoint: DeepSeek's names, their shapes and storage kinds, from the config.

Names are those of DeepSeek's release (`layers.L.attn.wq_a.weight`, `embed.weight`, `mtp.S.*`); the
shapes follow from `V41Config` and each layer's role (roles.py): only KV sources carry a compressor
(a gate only at ratio > 1), only index sources an indexer, only Engram layers an `engram.*`. How each
kind may be stored is checkpoint.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.roles import LayerRole

# Storage kinds (checkpoint.py says which dtypes each accepts):
FP8_BLOCK = "fp8_block"  # a dense projection: FP8 e4m3 with an e8m0 `.scale` per 32x32 block, or a float
FP4_EXPERT = "fp4_expert"  # a routed expert: e2m1 packed two per byte with an e8m0 `.scale` per 32, or a float
FP8_ROWS = "fp8_rows"  # an Engram table: FP8 e4m3 rows with an e8m0 `.scale` per row and 32 columns, or a float
FLOAT = "float"  # norms, embeddings, small projections: BF16 / F16 / F32
FLOAT32 = "float32"  # router, biases, sinks, hyper-connections: floats kept in float32
VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline", "image_pad")  # the vision tower: skipped


@dataclass(frozen=True)
class V41TensorSpec:
    shape: tuple[int, ...]
    kind: str
    optional: bool = False  # may be absent (its shape and dtype are checked when present)


def _block(config: V41Config, prefix: str, role: LayerRole | None, experts: int) -> dict[str, V41TensorSpec]:
    """One transformer block under `prefix` ("layers.3." or "mtp.0."); `role` None for a DSpark block."""
    c, h = config, config.hidden_size
    heads_dim = c.num_attention_heads * c.head_dim
    shared = c.moe_intermediate_size * c.n_shared_experts
    specs = {
        "attn_norm.weight": ((h,), FLOAT),
        "ffn_norm.weight": ((h,), FLOAT),
        "attn.wq_a.weight": ((c.q_lora_rank, h), FP8_BLOCK),
        "attn.q_norm.weight": ((c.q_lora_rank,), FLOAT),
        "attn.wq_b.weight": ((heads_dim, c.q_lora_rank), FP8_BLOCK),
        "attn.wkv.weight": ((c.head_dim, h), FP8_BLOCK),
        "attn.kv_norm.weight": ((c.head_dim,), FLOAT),
        "attn.wo_a.weight": ((c.o_groups * c.o_lora_rank, heads_dim // c.o_groups), FP8_BLOCK),  # block-diagonal per group, stacked
        "attn.wo_b.weight": ((h, c.o_groups * c.o_lora_rank), FP8_BLOCK),
        "attn.attn_sink": ((c.num_attention_heads,), FLOAT32),
        "ffn.gate.weight": ((experts, h), FLOAT32),
        "ffn.gate.bias": ((experts,), FLOAT32),
        "ffn.shared_experts.w1.weight": ((shared, h), FP8_BLOCK),
        "ffn.shared_experts.w3.weight": ((shared, h), FP8_BLOCK),
        "ffn.shared_experts.w2.weight": ((h, shared), FP8_BLOCK),
    }
    for site in ("attn", "ffn"):
        specs[f"hc_{site}_fn"] = ((c.hc_coefficients, c.hc_mult * h), FLOAT32)
        specs[f"hc_{site}_base"] = ((c.hc_coefficients,), FLOAT32)
        specs[f"hc_{site}_scale"] = ((3,), FLOAT32)
    for e in range(experts):
        specs[f"ffn.experts.{e}.w1.weight"] = ((c.moe_intermediate_size, h), FP4_EXPERT)
        specs[f"ffn.experts.{e}.w3.weight"] = ((c.moe_intermediate_size, h), FP4_EXPERT)
        specs[f"ffn.experts.{e}.w2.weight"] = ((h, c.moe_intermediate_size), FP4_EXPERT)
    if role is not None and role.has_compressor:
        specs["attn.compressor.wkv.weight"] = ((c.head_dim, h), FLOAT)
        if role.ratio > 1:  # a ratio-1 "compressor" projects each token alone: nothing to gate
            specs["attn.compressor.wgate.weight"] = ((c.head_dim, h), FLOAT)
        specs["attn.compressor.norm.weight"] = ((c.head_dim,), FLOAT)
        specs["attn.indexer.wk.weight"] = ((c.index_head_dim, c.head_dim), FLOAT)
        specs["attn.indexer.k_norm.weight"] = ((c.index_head_dim,), FLOAT)
    if role is not None and role.has_indexer:
        specs["attn.indexer.wq_b.weight"] = ((c.index_n_heads * c.index_head_dim, c.q_lora_rank), FP8_BLOCK)
        specs["attn.indexer.weights_proj.weight"] = ((c.index_n_heads, h), FLOAT)
    if role is not None and role.engram is not None:
        width = c.engram_hash_heads * c.engram_head_dim
        specs["engram.embed.weight"] = ((c.engram_num_embeddings[role.engram], c.engram_head_dim), FP8_ROWS)
        specs["engram.wkv.weight"] = (((c.hc_mult + 1) * h, width), FP8_BLOCK)  # a key per stream and one value
        specs["engram.q_weight"] = ((c.hc_mult, h), FLOAT)
        specs["engram.k_weight"] = ((c.hc_mult, h), FLOAT)
    out = {prefix + name: V41TensorSpec(shape, kind) for name, (shape, kind) in specs.items()}
    # Every backbone gate has an image-token bias; whether the draft blocks' gates ship one is not known (docs/models/deepseek_v41.md).
    out[prefix + "ffn.gate.bias_vl"] = V41TensorSpec((experts,), FLOAT32, optional=role is None)
    return out


def dspark_tensor_specs(config: V41Config) -> dict[str, V41TensorSpec]:
    """The DSpark draft blocks `mtp.0..n-1`: SWA-only blocks with their own MoE; the first projects the
    target layers' features, the last holds the output norm and the Markov and confidence heads."""
    c, h = config, config.hidden_size
    specs: dict[str, V41TensorSpec] = {}
    for s in range(c.num_nextn_predict_layers):
        specs.update(_block(c, f"mtp.{s}.", None, c.dspark_n_routed_experts))
    if c.num_nextn_predict_layers:
        last = f"mtp.{c.num_nextn_predict_layers - 1}."
        specs["mtp.0.main_proj.weight"] = V41TensorSpec((h, len(c.dspark_target_layer_ids) * h), FP8_BLOCK)
        specs["mtp.0.main_norm.weight"] = V41TensorSpec((h,), FLOAT)
        specs[last + "norm.weight"] = V41TensorSpec((h,), FLOAT)
        specs[last + "markov_head.embed.weight"] = V41TensorSpec((c.vocab_size, c.dspark_markov_rank), FLOAT)
        specs[last + "markov_head.head.weight"] = V41TensorSpec((c.vocab_size, c.dspark_markov_rank), FLOAT)
        specs[last + "confidence_head.proj.weight"] = V41TensorSpec((1, h + c.dspark_markov_rank), FLOAT32)
    return specs


def v41_tensor_specs(config: V41Config) -> dict[str, V41TensorSpec]:
    """Every text tensor of the checkpoint (backbone and DSpark blocks) by DeepSeek's name."""
    h = config.hidden_size
    specs = {"embed.weight": V41TensorSpec((config.vocab_size, h), FLOAT), "norm.weight": V41TensorSpec((h,), FLOAT)}
    if not config.tie_word_embeddings:
        specs["head.weight"] = V41TensorSpec((config.vocab_size, h), FLOAT)
    for role in config.roles:
        specs.update(_block(config, f"layers.{role.layer}.", role, config.n_routed_experts))
    specs.update(dspark_tensor_specs(config))
    return specs


def implied_tensor_count(config: V41Config) -> int:
    """About how many tensors the config implies, from its sizes alone (before any spec is listed)."""
    per_layer = 3 * config.n_routed_experts + 40
    return config.num_hidden_layers * per_layer + config.num_nextn_predict_layers * (3 * config.dspark_n_routed_experts + 40)


__all__ = [
    "V41TensorSpec",
    "v41_tensor_specs",
    "dspark_tensor_specs",
    "implied_tensor_count",
    "FP8_BLOCK",
    "FP4_EXPERT",
    "FP8_ROWS",
    "FLOAT",
    "FLOAT32",
    "VISION_PREFIXES",
]
