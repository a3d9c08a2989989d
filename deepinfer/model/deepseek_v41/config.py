"""`V41Config`: a DeepSeek-V4.1 `config.json` in its released nested form, checked once.

The release nests the language model under `text_config` (`deepseek_v41_text`) and the vision tower
under `vision_config`; `quantization_config` says FP8 e4m3 weights with e8m0 scales per 32x32 block and
FP4 routed experts. Every key V4.1 adds (cross-layer KV sources, hierarchical candidates, Engram, DSpark)
is parsed with its bounds, and each layer's role is derived from them (`roles.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from deepinfer.model.deepseek_v4.config import FLOAT32_MAX, MAX_INDEX_TOPK, MAX_SINKHORN_ITERS, MAX_SLIDING_WINDOW, ROPE_FIELDS
from deepinfer.model.deepseek_v41.roles import LayerRole, layer_roles
from deepinfer.model.errors import CheckpointError
from deepinfer.model.schema import BOOLEAN, REQUIRED, Field, Kind, check_fields, check_object, integer, integers, number, one_of

MODEL_TYPE = "deepseek_v41"
TEXT_MODEL_TYPE = "deepseek_v41_text"
VISION_MODEL_TYPE = "deepseek_v41_vision"
WEIGHT_BLOCK = 32  # the release's FP8 weight scale block: 32x32 (V4's is 128x128)
# Bounds of fields that size no checkpoint tensor but a per-step table or a loop (as V4's, config.py there):
MAX_COMPRESS_RATIO = 128  # compressed entries are paged in KV blocks; ratios are powers of two up to V4's 128
MAX_CANDIDATE_BLOCKS = 1 << 20  # each step's [tokens, candidate_topk_blocks] kept-block table
MAX_CANDIDATE_BLOCK_SIZE = 4096  # compressed entries per candidate block (the release: 8)
MAX_NGRAM = 8  # Engram n-gram orders 2..max: hash heads per token grow with it (the release: 4)
MAX_DSPARK_BLOCK = 64  # draft tokens per DSpark block (the release: 5)


def _layer_ids() -> Kind:
    return Kind(
        "a list of layer ids (integers >= 0)", lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    )


def _counts() -> Kind:
    return Kind("a list of integers >= 1", lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v))


def _ratios() -> Kind:
    ok = lambda r: isinstance(r, int) and not isinstance(r, bool) and (r == 0 or (0 < r <= MAX_COMPRESS_RATIO and not r & (r - 1)))  # noqa: E731
    return Kind(f"a list of compress ratios, each 0 or a power of two up to {MAX_COMPRESS_RATIO}", lambda v: isinstance(v, list) and all(ok(r) for r in v))


@dataclass(frozen=True)
class V41VisionConfig:
    """The vision tower's size: its tensors are recognised and skipped (text-only serving)."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int


@dataclass(frozen=True)
class V41Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # one per backbone layer, then one (0) per DSpark block
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int  # -1: no hierarchical candidate selection
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    rope_theta: float  # compress ratio 0 layers (and DSpark)
    compress_rope: Mapping[str, Any]  # every layer with compress ratio > 0: {"rope_theta", YaRN keys}
    max_position_embeddings: int
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]  # rows of each Engram table
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int  # DSpark draft blocks mtp.0..n-1
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    image_token_id: int | None
    tie_word_embeddings: bool
    quantization: Mapping[str, Any] | None  # {"weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    vision: V41VisionConfig | None
    roles: tuple[LayerRole, ...]  # one per backbone layer (roles.py)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    model_type: str = MODEL_TYPE
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def engram_hash_heads(self) -> int:
        """Table rows each token looks up per Engram layer: one per n-gram order 2..max and head (the release: 24)."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def hc_coefficients(self) -> int:
        """Rows of a site's hyper-connection projection: pre and post per stream, and the stream mix (the release: 24)."""
        return (2 + self.hc_mult) * self.hc_mult

    # ---- parsing ------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], source: str = "config.json") -> "V41Config":
        def bad(message: str):
            raise CheckpointError(f"{source}: {message}")

        top = check_fields(cfg, TOP_FIELDS, source)
        text = check_object(cfg.get("text_config"), "text_config", source)
        if text is None:
            bad("text_config is missing: a deepseek_v41 config.json nests the language model's keys under text_config")
        v = check_fields(text, TEXT_FIELDS, source, where="text_config.")
        layers, blocks = v["num_hidden_layers"], v["num_nextn_predict_layers"]
        ratios = v["compress_ratios"]
        if len(ratios) != layers + blocks:
            bad(f"text_config.compress_ratios has {len(ratios)} entries, expected num_hidden_layers + num_nextn_predict_layers = {layers} + {blocks}")
        if any(ratios[layers:]):
            bad(f"text_config.compress_ratios ends with {ratios[layers:]} for the DSpark blocks, expected 0 each (they attend to a sliding window only)")
        if v["window_size"] is not None and v["window_size"] != v["sliding_window"]:
            bad(f"text_config.window_size is {v['window_size']} but sliding_window is {v['sliding_window']}; they name the same window")
        roles = layer_roles(
            layers, ratios, v["kv_source_layer_ids"], v["index_source_layer_ids"], v["candidate_source_layer_id"], v["engram_layer_ids"],
            lambda m: bad(f"text_config: {m}"),
        )  # fmt: skip
        eos = top["eos_token_id"] if top["eos_token_id"] is not None else v["eos_token_id"]
        config = cls(
            **{k: v[k] for k in _COPIED},
            compress_ratios=tuple(ratios),
            kv_source_layer_ids=tuple(v["kv_source_layer_ids"]),
            index_source_layer_ids=tuple(v["index_source_layer_ids"]),
            engram_layer_ids=tuple(v["engram_layer_ids"]),
            engram_num_embeddings=tuple(v["engram_num_embeddings"]),
            dspark_target_layer_ids=tuple(v["dspark_target_layer_ids"]),
            hc_eps=float(v["hc_eps"]),
            routed_scaling_factor=float(v["routed_scaling_factor"]),
            swiglu_limit=float(v["swiglu_limit"]),
            rms_norm_eps=float(v["rms_norm_eps"]),
            rope_theta=float(v["rope_theta"]),
            compress_rope=_compress_rope(text, float(v["compress_rope_theta"]), source),
            image_token_id=top["image_token_id"],
            tie_word_embeddings=top["tie_word_embeddings"],
            quantization=_quantization(cfg, source),
            vision=_vision(cfg, source),
            roles=roles,
            bos_token_id=top["bos_token_id"] if top["bos_token_id"] is not None else v["bos_token_id"],
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            raw=dict(cfg),
        )
        config._check(bad)
        return config

    def _check(self, bad) -> None:
        """Relations between fields (each field's own type and range are TEXT_FIELDS')."""
        t = "text_config."
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            bad(f"{t}qk_rope_head_dim={self.qk_rope_head_dim} must be even and at most head_dim={self.head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            bad(f"{t}index_head_dim={self.index_head_dim} is narrower than qk_rope_head_dim={self.qk_rope_head_dim} (the indexer rotates its last rope lanes)")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            bad(f"{t}o_groups={self.o_groups} does not divide num_attention_heads x head_dim = {self.num_attention_heads * self.head_dim}")
        if self.num_experts_per_tok > self.n_routed_experts:
            bad(f"{t}num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}")
        if self.candidate_source_layer_id != -1:
            blocks, size = self.candidate_topk_blocks, self.candidate_block_size
            if blocks < 1 or size < 1:
                bad(f"{t}candidate_topk_blocks={blocks} and candidate_block_size={size} must be >= 1 while candidate_source_layer_id is set")
            if blocks * size - (size - 1) < self.index_topk:  # the fewest entries the kept blocks may hold must cover one top-k
                fewest = blocks * size - (size - 1)
                bad(f"{t}candidate_topk_blocks x candidate_block_size - (candidate_block_size - 1) = {fewest} is below index_topk={self.index_topk}")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            bad(f"{t}engram_num_embeddings has {len(self.engram_num_embeddings)} tables for {len(self.engram_layer_ids)} engram_layer_ids")
        for layer, rows in zip(self.engram_layer_ids, self.engram_num_embeddings):
            if rows < self.engram_hash_heads:
                bad(f"{t}engram_num_embeddings gives layer {layer} {rows} rows, fewer than its {self.engram_hash_heads} hash heads (one table slice each)")
        if self.engram_layer_ids and not self.engram_pad_token_id < self.engram_compressed_vocab_size:
            bad(f"{t}engram_pad_token_id={self.engram_pad_token_id} is not below engram_compressed_vocab_size={self.engram_compressed_vocab_size}")
        if self.engram_compressed_vocab_size > self.vocab_size:
            bad(f"{t}engram_compressed_vocab_size={self.engram_compressed_vocab_size} exceeds vocab_size={self.vocab_size}")
        if self.num_nextn_predict_layers:
            targets = self.dspark_target_layer_ids
            if not targets:
                bad(f"{t}dspark_target_layer_ids is empty, but num_nextn_predict_layers={self.num_nextn_predict_layers} DSpark blocks need target layers")
            outside = [i for i in targets if i >= self.num_hidden_layers]
            if outside or len(set(targets)) != len(targets):
                bad(f"{t}dspark_target_layer_ids is {list(targets)}, expected distinct layers below num_hidden_layers={self.num_hidden_layers}")
            if self.dspark_num_experts_per_tok > self.dspark_n_routed_experts:
                bad(f"{t}dspark_num_experts_per_tok={self.dspark_num_experts_per_tok} exceeds dspark_n_routed_experts={self.dspark_n_routed_experts}")
            if self.dspark_noise_token_id >= self.vocab_size:
                bad(f"{t}dspark_noise_token_id={self.dspark_noise_token_id} is not below vocab_size={self.vocab_size}")
        for name, token in (("image_token_id", self.image_token_id), ("bos_token_id", self.bos_token_id), *(("eos_token_id", e) for e in self.eos_token_ids)):
            if token is not None and token >= self.vocab_size:
                bad(f"{name}={token} is not below text_config.vocab_size={self.vocab_size}")


def _yes(value: Any) -> Kind:
    return Kind(f"{value!r} (V4.1's only choice)", lambda v: v == value and not isinstance(v, bool))


TOP_FIELDS = (
    Field("model_type", one_of(MODEL_TYPE), REQUIRED),
    Field("bos_token_id", integer(min=0)),
    Field("eos_token_id", integers(min=0)),
    Field("pad_token_id", integer(min=0)),
    Field("image_token_id", integer(min=0)),
    Field("tie_word_embeddings", BOOLEAN, False),
    Field("deepinfer_dummy_weights", BOOLEAN, False),
)
TEXT_FIELDS = (
    Field("model_type", one_of(TEXT_MODEL_TYPE), TEXT_MODEL_TYPE),
    Field("vocab_size", integer(min=1), REQUIRED),
    Field("hidden_size", integer(min=1), REQUIRED),
    Field("num_hidden_layers", integer(min=1), REQUIRED),
    Field("num_attention_heads", integer(min=1), REQUIRED),
    Field("num_key_value_heads", _yes(1), 1),  # one shared latent, K = V
    Field("head_dim", integer(min=2), REQUIRED),
    Field("qk_rope_head_dim", integer(min=2), REQUIRED),
    Field("q_lora_rank", integer(min=1), REQUIRED),
    Field("o_lora_rank", integer(min=1), REQUIRED),
    Field("o_groups", integer(min=1), REQUIRED),
    Field("hidden_act", one_of("silu"), "silu"),
    Field("swiglu_limit", number(above=0, max=FLOAT32_MAX), 10.0),
    Field("rms_norm_eps", number(above=0), 1e-20),
    Field("max_position_embeddings", integer(min=2), REQUIRED),
    Field("rope_theta", number(above=1), 10000.0),
    Field("compress_rope_theta", number(above=1), 160000.0),
    Field("n_routed_experts", integer(min=1), REQUIRED),
    Field("n_shared_experts", _yes(1), 1),
    Field("num_experts_per_tok", integer(min=1), REQUIRED),
    Field("moe_intermediate_size", integer(min=1), REQUIRED),
    Field("scoring_func", one_of("sqrtsoftplus"), "sqrtsoftplus"),
    Field("topk_method", one_of("noaux_tc"), "noaux_tc"),
    Field("norm_topk_prob", BOOLEAN, True),
    Field("routed_scaling_factor", number(above=0), 1.5),
    Field("first_k_dense_replace", _yes(0), 0),  # every V4.1 layer is MoE
    Field("sliding_window", integer(min=1, max=MAX_SLIDING_WINDOW), REQUIRED),
    Field("window_size", integer(min=1, max=MAX_SLIDING_WINDOW)),
    Field("compress_ratios", _ratios(), REQUIRED),
    Field("kv_source_layer_ids", _layer_ids(), REQUIRED),
    Field("index_source_layer_ids", _layer_ids(), REQUIRED),
    Field("index_n_heads", integer(min=1), REQUIRED),
    Field("index_head_dim", integer(min=2), REQUIRED),
    Field("index_topk", integer(min=1, max=MAX_INDEX_TOPK), REQUIRED),
    Field("candidate_source_layer_id", integer(min=-1), -1),
    Field("candidate_topk_blocks", integer(min=-1, max=MAX_CANDIDATE_BLOCKS), -1),
    Field("candidate_block_size", integer(min=-1, max=MAX_CANDIDATE_BLOCK_SIZE), -1),
    Field("hc_mult", integer(min=1, max=64), 4),
    Field("hc_sinkhorn_iters", integer(min=1, max=MAX_SINKHORN_ITERS), 20),
    Field("hc_eps", number(above=0), 1e-6),
    Field("engram_layer_ids", _layer_ids(), []),
    Field("engram_num_embeddings", _counts(), []),
    Field("engram_max_ngram_size", integer(min=2, max=MAX_NGRAM), 4),
    Field("engram_n_heads", integer(min=1), 8),
    Field("engram_head_dim", integer(min=1), 256),
    Field("engram_vocab_size", integer(min=1), 16000000),
    Field("engram_pad_token_id", integer(min=0), 2),
    Field("engram_compressed_vocab_size", integer(min=1), 99092),
    Field("num_nextn_predict_layers", integer(min=0), 0),
    Field("dspark_block_size", integer(min=1, max=MAX_DSPARK_BLOCK), 5),
    Field("dspark_noise_token_id", integer(min=0), 128799),
    Field("dspark_target_layer_ids", _layer_ids(), []),
    Field("dspark_markov_rank", integer(min=1), 256),
    Field("dspark_n_routed_experts", integer(min=1), 128),
    Field("dspark_num_experts_per_tok", integer(min=1), 3),
    Field("bos_token_id", integer(min=0)),
    Field("eos_token_id", integers(min=0)),
)
_COPIED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups",
    "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "candidate_source_layer_id", "candidate_topk_blocks",
    "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
    "scoring_func", "norm_topk_prob", "max_position_embeddings", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim", "engram_vocab_size",
    "engram_pad_token_id", "engram_compressed_vocab_size", "num_nextn_predict_layers", "dspark_block_size", "dspark_noise_token_id",
    "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok",
)  # fmt: skip
QUANT_FIELDS = (
    Field("quant_method", one_of("fp8"), REQUIRED),
    Field("activation_scheme", one_of("dynamic"), "dynamic"),
    Field("weight_block_size", Kind("[32, 32] (V4.1's release)", lambda v: v == [WEIGHT_BLOCK, WEIGHT_BLOCK]), [WEIGHT_BLOCK, WEIGHT_BLOCK]),
    Field("scale_fmt", one_of("ue8m0"), "ue8m0"),
    Field("expert_dtype", one_of("fp4"), "fp4"),
)
VISION_FIELDS = (
    Field("model_type", one_of(VISION_MODEL_TYPE), VISION_MODEL_TYPE),
    Field("num_hidden_layers", integer(min=0), 0),
    Field("hidden_size", integer(min=1), 1024),
    Field("num_attention_heads", integer(min=1), 16),
    Field("intermediate_size", integer(min=1), 2816),
    Field("patch_size", integer(min=1), 14),
)


def _compress_rope(text: Mapping[str, Any], theta: float, source: str) -> dict:
    """The rope of every layer with compress ratio > 0: base `compress_rope_theta`, with YaRN when
    `rope_scaling` says so (V4.1 scales only these layers; ratio-0 layers use plain `rope_theta`)."""
    where = "text_config.rope_scaling."
    scaling = check_object(text.get("rope_scaling"), "text_config.rope_scaling", source) or {}
    c = check_fields(scaling, ROPE_FIELDS, source, where=where)
    rope = {"rope_theta": theta}
    if (c["rope_type"] or c["type"] or "default") == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            if c[key] is None:
                raise CheckpointError(f"{source}: {where}{key} is required for yarn rope scaling")
        rope.update({k: c[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow") if c[k] is not None})
        rope.update(rope_type="yarn", attention_factor=float(c["attention_factor"] or 1.0))
    return rope


def _quantization(cfg: Mapping[str, Any], source: str) -> dict | None:
    qc = check_object(cfg.get("quantization_config"), "quantization_config", source)
    if qc is None:
        return None
    v = check_fields(qc, QUANT_FIELDS, source, where="quantization_config.")
    return {"weight_block_size": v["weight_block_size"], "scale_fmt": v["scale_fmt"], "expert_dtype": v["expert_dtype"]}


def _vision(cfg: Mapping[str, Any], source: str) -> V41VisionConfig | None:
    vc = check_object(cfg.get("vision_config"), "vision_config", source)
    if vc is None:
        return None
    v = check_fields(vc, VISION_FIELDS, source, where="vision_config.")
    return V41VisionConfig(**{k: v[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "patch_size")})


__all__ = ["V41Config", "V41VisionConfig", "MODEL_TYPE", "WEIGHT_BLOCK"]
