"""`ModelConfig`: the fields of an HF DeepSeek V2/V3 `config.json` the model needs, checked once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from deepinfer.model.errors import LoadError
from deepinfer.ops.rope import yarn_mscale

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
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
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise LoadError(f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        routing = {**_ROUTING_DEFAULTS[model_type], **{k: cfg[k] for k in _ROUTING_DEFAULTS[model_type] if cfg.get(k) is not None}}

        def need(key: str):
            if cfg.get(key) is None:
                raise LoadError(f"{source}: required field {key!r} is missing; add it to the config")
            return cfg[key]

        def get(key: str, default):
            value = cfg.get(key)
            return default if value is None else value

        _refuse_unsupported(cfg, source)
        if routing["topk_method"] not in TOPK_METHODS:
            raise LoadError(f"{source}: topk_method {routing['topk_method']!r} is not supported; supported: {', '.join(TOPK_METHODS)}")
        rope_scaling, rope_theta = _rope(cfg, source)
        eos = cfg.get("eos_token_id")
        config = cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=int(need("num_attention_heads")),
            q_lora_rank=None if cfg.get("q_lora_rank") is None else int(cfg["q_lora_rank"]),
            kv_lora_rank=int(need("kv_lora_rank")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            moe_intermediate_size=int(get("moe_intermediate_size", 0)),
            n_routed_experts=None if not cfg.get("n_routed_experts") else int(cfg["n_routed_experts"]),
            n_shared_experts=int(get("n_shared_experts", 0)),
            num_experts_per_tok=int(get("num_experts_per_tok", 1)),
            n_group=int(get("n_group", 1)),
            topk_group=int(get("topk_group", 1)),
            topk_method=routing["topk_method"],
            scoring_func=routing["scoring_func"],
            norm_topk_prob=bool(routing["norm_topk_prob"]),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(get("first_k_dense_replace", 0)),
            moe_layer_freq=int(get("moe_layer_freq", 1)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_interleave=bool(get("rope_interleave", True)),
            max_position_embeddings=int(need("max_position_embeddings")),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            num_nextn_predict_layers=int(get("num_nextn_predict_layers", 0)),
            quantization=_quantization(cfg.get("quantization_config"), source),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            raw=dict(cfg),
        )
        config._check(source)
        return config

    def _check(self, source: str) -> None:
        def bad(message: str):
            raise LoadError(f"{source}: {message}")

        if self.qk_rope_head_dim % 2:
            bad(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.moe_layer_freq < 1:
            bad(f"moe_layer_freq={self.moe_layer_freq} must be >= 1")
        if self.n_routed_experts:
            if self.moe_intermediate_size <= 0:
                bad("moe_intermediate_size is missing for a MoE model")
            n_group, topk_group = self.routing_groups
            if n_group < 1 or self.n_routed_experts % n_group:
                bad(f"n_group={n_group} does not divide n_routed_experts={self.n_routed_experts}")
            if not 1 <= topk_group <= n_group:
                bad(f"topk_group={topk_group} must lie in [1, n_group={n_group}]")
            if not 1 <= self.num_experts_per_tok <= topk_group * (self.n_routed_experts // n_group):
                bad(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts of the {topk_group} kept groups")
            if self.scoring_func not in ("softmax", "sigmoid", "sqrtsoftplus"):
                bad(f"scoring_func {self.scoring_func!r} is not supported; supported: softmax, sigmoid, sqrtsoftplus")


def _refuse_unsupported(cfg: Mapping[str, Any], source: str) -> None:
    if cfg.get("attention_bias"):
        raise LoadError(f"{source}: attention_bias=true is not supported (DeepSeek checkpoints have no attention biases)")
    if cfg.get("mlp_bias"):
        raise LoadError(f"{source}: mlp_bias=true is not supported (DeepSeek checkpoints have no MLP biases)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise LoadError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported; DeepSeek uses silu")


def _rope(cfg: Mapping[str, Any], source: str) -> tuple[dict | None, float]:
    """(the YaRN dict or None, rope_theta) from `rope_scaling` (older configs) or `rope_parameters` (transformers 5)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None, theta
    if kind != "yarn":
        raise LoadError(f"{source}: rope type {kind!r} is not supported; supported: default, yarn")
    if not params.get("factor"):
        raise LoadError(f"{source}: yarn rope scaling needs a 'factor'")
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = "yarn"  # one spelling, whichever form the config used
    return scaling, theta


def _quantization(qc: Mapping[str, Any] | None, source: str) -> QuantConfig | None:
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise LoadError(f"{source}: quantization_config quant_method {method!r} is not supported; supported: fp8 (block 128x128)")
    block = list(qc.get("weight_block_size") or [])
    if block != FP8_BLOCK:
        raise LoadError(f"{source}: fp8 weight_block_size {block} is not supported; supported: {FP8_BLOCK}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise LoadError(f"{source}: fp8 activation_scheme {qc['activation_scheme']!r} is not supported; supported: dynamic")
    return QuantConfig()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["ModelConfig", "QuantConfig", "SUPPORTED_MODEL_TYPES", "ceil_div"]
