"""`ModelConfig`: the fields of an HF DeepSeek V2/V3 `config.json` the model needs, checked once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from deepinfer.model.errors import CheckpointError
from deepinfer.model.schema import BOOLEAN, REQUIRED, Field, Kind, check_fields, check_object, integer, integers, number, one_of
from deepinfer.ops.rope import yarn_mscale

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
ROPE_TYPES = ("default", "yarn")
FP8_BLOCK = [128, 128]

# Routing defaults when config.json leaves them out (transformers' DeepseekV3Config writes neither).
_ROUTING_DEFAULTS = {
    "deepseek_v2": {"topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False},
    "deepseek_v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True},
}


@dataclass(frozen=True)
class QuantConfig:
    """DeepSeek-V3's FP8: e4m3 weights with a float32 multiplier per 128x128 block (`weight_scale_inv`)."""

    method: str = "fp8"
    weight_block_size: tuple[int, int] = (128, 128)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int | None  # None or 0: every layer is dense
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None  # the yarn dict (rope_scaling or rope_parameters), None for plain RoPE
    rope_interleave: bool
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_nextn_predict_layers: int
    quantization: QuantConfig | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_width(self) -> int:
        """Values per token and layer in the latent cache: the latent, then the rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """(nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's reference)."""
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling and self.rope_scaling.get("mscale_all_dim"):
            m = yarn_mscale(float(self.rope_scaling["factor"]), float(self.rope_scaling["mscale_all_dim"]))
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.n_routed_experts) and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def uses_correction_bias(self) -> bool:
        """noaux_tc routing selects with `e_score_correction_bias` (config-driven, not by hidden size)."""
        return self.topk_method == "noaux_tc"

    @property
    def routing_groups(self) -> tuple[int, int]:
        """(n_group, topk_group) the gate uses: greedy routing ignores groups."""
        return (1, 1) if self.topk_method == "greedy" else (self.n_group, self.topk_group)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Check `cfg` against CONFIG_FIELDS (types and ranges), then the relations between fields."""
        v = check_fields(cfg, CONFIG_FIELDS, source)
        model_type = v["model_type"]
        routing = {k: default if v[k] is None else v[k] for k, default in _ROUTING_DEFAULTS[model_type].items()}
        for name, value in (("attention_bias", v["attention_bias"]), ("mlp_bias", v["mlp_bias"])):
            if value:
                raise CheckpointError(f"{source}: {name}=true is not supported (DeepSeek checkpoints have no {name.split('_')[0]} biases)")
        rope_scaling, rope_theta = _rope(cfg, v["rope_theta"], source)
        eos = v["eos_token_id"]
        config = cls(
            model_type=model_type,
            vocab_size=v["vocab_size"],
            hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"],
            num_hidden_layers=v["num_hidden_layers"],
            num_attention_heads=v["num_attention_heads"],
            q_lora_rank=v["q_lora_rank"],
            kv_lora_rank=v["kv_lora_rank"],
            qk_nope_head_dim=v["qk_nope_head_dim"],
            qk_rope_head_dim=v["qk_rope_head_dim"],
            v_head_dim=v["v_head_dim"],
            moe_intermediate_size=v["moe_intermediate_size"],
            n_routed_experts=v["n_routed_experts"] or None,
            n_shared_experts=v["n_shared_experts"],
            num_experts_per_tok=v["num_experts_per_tok"],
            n_group=v["n_group"],
            topk_group=v["topk_group"],
            topk_method=routing["topk_method"],
            scoring_func=routing["scoring_func"],
            norm_topk_prob=routing["norm_topk_prob"],
            routed_scaling_factor=float(v["routed_scaling_factor"]),
            first_k_dense_replace=v["first_k_dense_replace"],
            moe_layer_freq=v["moe_layer_freq"],
            rms_norm_eps=float(v["rms_norm_eps"]),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_interleave=v["rope_interleave"],
            max_position_embeddings=v["max_position_embeddings"],
            tie_word_embeddings=v["tie_word_embeddings"],
            num_nextn_predict_layers=v["num_nextn_predict_layers"],
            quantization=_quantization(cfg.get("quantization_config"), source),
            bos_token_id=v["bos_token_id"],
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            raw=dict(cfg),
        )
        config._check(source)
        return config

    def _check(self, source: str) -> None:
        """Relations between fields (each field's own type and range are CONFIG_FIELDS')."""

        def bad(message: str):
            raise CheckpointError(f"{source}: {message}")

        if self.qk_rope_head_dim % 2:
            bad(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.bos_token_id is not None and self.bos_token_id >= self.vocab_size:
            bad(f"bos_token_id={self.bos_token_id} is not below vocab_size={self.vocab_size}")
        for eos in self.eos_token_ids:
            if eos >= self.vocab_size:
                bad(f"eos_token_id {eos} is not below vocab_size={self.vocab_size}")
        if self.num_nextn_predict_layers > self.num_hidden_layers:
            bad(f"num_nextn_predict_layers={self.num_nextn_predict_layers} exceeds num_hidden_layers={self.num_hidden_layers}")
        if self.n_routed_experts:
            if self.moe_intermediate_size <= 0:
                bad("moe_intermediate_size is missing for a MoE model")
            n_group, topk_group = self.routing_groups
            if self.n_routed_experts % n_group:
                bad(f"n_group={n_group} does not divide n_routed_experts={self.n_routed_experts}")
            if not topk_group <= n_group:
                bad(f"topk_group={topk_group} must lie in [1, n_group={n_group}]")
            if self.uses_correction_bias and n_group > 1 and self.n_routed_experts // n_group < 2:
                bad(f"n_group={n_group} leaves one expert per group of n_routed_experts={self.n_routed_experts}; "
                    f"{self.topk_method} routing scores a group by its top two experts, so a group needs at least 2")
            if not self.num_experts_per_tok <= topk_group * (self.n_routed_experts // n_group):
                bad(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts of the {topk_group} kept groups")


# config.json's fields the model reads: kind and range, and the default when absent or null.
CONFIG_FIELDS = (
    Field("model_type", one_of(*SUPPORTED_MODEL_TYPES), REQUIRED),
    Field("vocab_size", integer(min=1), REQUIRED),
    Field("hidden_size", integer(min=1), REQUIRED),
    Field("intermediate_size", integer(min=1), REQUIRED),
    Field("num_hidden_layers", integer(min=1), REQUIRED),
    Field("num_attention_heads", integer(min=1), REQUIRED),
    Field("q_lora_rank", integer(min=1)),  # null: a plain q_proj
    Field("kv_lora_rank", integer(min=1), REQUIRED),
    Field("qk_nope_head_dim", integer(min=1), REQUIRED),
    Field("qk_rope_head_dim", integer(min=2), REQUIRED),
    Field("v_head_dim", integer(min=1), REQUIRED),
    Field("max_position_embeddings", integer(min=2), REQUIRED),
    Field("moe_intermediate_size", integer(min=0), 0),
    Field("n_routed_experts", integer(min=0), 0),  # 0 or null: every layer is dense
    Field("n_shared_experts", integer(min=0), 0),
    Field("num_experts_per_tok", integer(min=1), 1),
    Field("n_group", integer(min=1), 1),
    Field("topk_group", integer(min=1), 1),
    Field("topk_method", one_of(*TOPK_METHODS)),  # null: the model type's default (_ROUTING_DEFAULTS)
    Field("scoring_func", one_of(*SCORING_FUNCS)),
    Field("norm_topk_prob", BOOLEAN),
    Field("routed_scaling_factor", number(above=0), 1.0),
    Field("first_k_dense_replace", integer(min=0), 0),
    Field("moe_layer_freq", integer(min=1), 1),
    Field("rms_norm_eps", number(above=0), 1e-6),
    Field("rope_theta", number(above=1), 10000.0),  # a RoPE base; YaRN divides by its log
    Field("rope_interleave", BOOLEAN, True),
    Field("tie_word_embeddings", BOOLEAN, False),
    Field("num_nextn_predict_layers", integer(min=0), 0),
    Field("bos_token_id", integer(min=0)),
    Field("eos_token_id", integers(min=0)),
    Field("hidden_act", one_of("silu"), "silu"),
    Field("attention_bias", BOOLEAN, False),
    Field("mlp_bias", BOOLEAN, False),
    Field("deepinfer_dummy_weights", BOOLEAN, False),
)

# The RoPE object (`rope_parameters`, transformers 5, or `rope_scaling`): its own base and type.
ROPE_FIELDS = (
    Field("rope_theta", number(above=1)),  # null: config.json's top-level rope_theta
    Field("rope_type", one_of(*ROPE_TYPES)),
    Field("type", one_of(*ROPE_TYPES)),  # the older spelling of rope_type
)
YARN_FIELDS = (
    Field("factor", number(above=0), REQUIRED),
    Field("original_max_position_embeddings", integer(min=1), REQUIRED),
    Field("beta_fast", number(above=0)),
    Field("beta_slow", number(above=0)),
    Field("mscale", number(min=0)),
    Field("mscale_all_dim", number(min=0)),
    Field("attention_factor", number(above=0)),
)
QUANT_FIELDS = (
    Field("quant_method", one_of("fp8"), REQUIRED),
    Field("weight_block_size", Kind(f"{FP8_BLOCK} (the one fp8 block size supported)", lambda v: v == FP8_BLOCK and all(type(x) is int for x in v)), REQUIRED),
    Field("activation_scheme", one_of("dynamic"), "dynamic"),
)


def _rope(cfg: Mapping[str, Any], top_theta: float, source: str) -> tuple[dict | None, float]:
    """(the YaRN dict or None, rope_theta) from `rope_parameters` (transformers 5) or `rope_scaling` (older configs)."""
    objects = {key: check_object(cfg.get(key), key, source) for key in ("rope_parameters", "rope_scaling")}
    key, params = next(((k, p) for k, p in objects.items() if p), ("rope_scaling", {}))
    v = check_fields(params, ROPE_FIELDS, source, where=f"{key}.")
    theta = float(top_theta if v["rope_theta"] is None else v["rope_theta"])
    kind = v["rope_type"] or v["type"] or "default"
    if kind == "default":
        return None, theta
    check_fields(params, YARN_FIELDS, source, where=f"{key}.")
    scaling = {k: val for k, val in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = "yarn"  # one spelling, whichever form the config used
    return scaling, theta


def _quantization(qc: Any, source: str) -> QuantConfig | None:
    qc = check_object(qc, "quantization_config", source)
    if qc is None:
        return None
    check_fields(qc, QUANT_FIELDS, source, where="quantization_config.")
    return QuantConfig()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["ModelConfig", "QuantConfig", "SUPPORTED_MODEL_TYPES", "ceil_div"]
