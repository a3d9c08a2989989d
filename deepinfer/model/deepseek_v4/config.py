"""`V4Config`: the fields of a DeepSeek-V4 `config.json` (transformers' `deepseek_v4`), checked once.

Accepts transformers' spelling (`layer_types`, `compress_rates`, `mlp_layer_types`,
`partial_rotary_factor`, `rope_parameters` nested as {main, compress}) and the older one DeepSeek's
exports and transformers still read (`compress_ratios` per layer, `num_hash_layers`,
`qk_rope_head_dim`, a flat YaRN `rope_parameters` / `rope_scaling` for the compressed branches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from deepinfer.model.errors import CheckpointError
from deepinfer.model.schema import BOOLEAN, REQUIRED, Field, Kind, check_fields, check_object, integer, integers, number, one_of

MODEL_TYPE = "deepseek_v4"
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # the legacy per-layer `compress_ratios`
ROPE_TYPES = ("default", "yarn")
FLOAT32_MAX = 3.4028234663852886e38  # swiglu_limit reaches the kernels as a float32
# Fields that size no tensor of the checkpoint (so neither the shape checks nor the memory check bound
# them) but a per-step table or a loop: a hostile value would be an OOM or a hang at the first step.
# Each bound is far above what a released model uses (V4: window 128, top-k 512 / 1024, 20 Sinkhorn
# iterations; V3.2's indexer: top-k 2048; sliding-window models: windows up to 4096).
MAX_SLIDING_WINDOW = 16384  # each step's [tokens, sliding_window] row table
MAX_INDEX_TOPK = 16384  # each CSA layer's [tokens, index_topk] selected entries per step
MAX_SINKHORN_ITERS = 256  # iterations per hyper-connection mix, per layer and step


def _string_list(choices: tuple[str, ...]) -> Kind:
    return Kind(f"a list of {' / '.join(choices)}", lambda v: isinstance(v, list) and all(x in choices for x in v))


@dataclass(frozen=True)
class V4Config:
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
    layer_types: tuple[str, ...]
    compress_rates: Mapping[str, int]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    rope_theta: float  # sliding-only layers ("main" rope)
    compress_rope: Mapping[str, Any]  # CSA / HCA layers and their compressors: {"rope_theta", optional YaRN keys}
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_nextn_predict_layers: int
    quantization: Mapping[str, Any] | None  # {"fmt": "e4m3", "scale_fmt": "ue8m0"|None, "expert_dtype": "fp4"|None}
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    model_type: str = MODEL_TYPE
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived ------------------------------------------------------------------------------

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    def compress_ratio(self, layer: int) -> int:
        """The layer's compression ratio (0: sliding window only)."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else int(self.compress_rates[kind])

    @property
    def ratios(self) -> tuple[int, ...]:
        return tuple(sorted({self.compress_ratio(i) for i in range(self.num_hidden_layers)} - {0}))

    @property
    def prefix_replay_tokens(self) -> int:
        """Tokens recomputed before the new ones on a prefix-cache hit: the compressors' open windows
        (and, with overlap, the window before) are rebuilt from them; at least the sliding window."""
        spans = [2 * r if self.layer_types[i] == CSA else r for i in range(self.num_hidden_layers) if (r := self.compress_ratio(i))]
        return max([self.sliding_window, *spans])

    # ---- parsing ------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], source: str = "config.json") -> "V4Config":
        v = check_fields(cfg, FIELDS, source)
        layers = v["num_hidden_layers"]

        def bad(message: str):
            raise CheckpointError(f"{source}: {message}")

        rates = dict(check_object(cfg.get("compress_rates"), "compress_rates", source) or {CSA: 4, HCA: 128})
        if v["compress_rate_csa"] is not None:
            rates[CSA] = v["compress_rate_csa"]
        if v["compress_rate_hca"] is not None:
            rates[HCA] = v["compress_rate_hca"]
        for kind in (CSA, HCA):
            rate = rates.get(kind)
            if not (isinstance(rate, int) and not isinstance(rate, bool) and rate >= 1):
                bad(f"compress_rates.{kind} must be an integer >= 1, got {rate!r}")
            if rate & (rate - 1):  # the caches page entries in KV blocks of 16, 64 or 128 tokens: one must divide the other
                bad(f"compress_rates.{kind} is {rate}, expected a power of two (1, 2, 4, ..., as DeepSeek's 4 and 128)")
        layer_types = v["layer_types"]
        if layer_types is None and v["compress_ratios"] is not None:
            unknown = [r for r in v["compress_ratios"] if r not in _RATIO_TO_TYPE]
            if unknown:
                bad(f"compress_ratios holds {unknown[0]}; each must be 0, 4 or 128")
            layer_types = [_RATIO_TO_TYPE[r] for r in v["compress_ratios"]]
        if layer_types is None:  # transformers' default: two HCA layers, then CSA / HCA alternating
            layer_types = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
        mlp_types = v["mlp_layer_types"]
        if mlp_types is None:
            n_hash = 3 if v["num_hash_layers"] is None else v["num_hash_layers"]
            mlp_types = [HASH_MOE] * min(layers, n_hash) + [MOE] * max(0, layers - n_hash)
        for name, types in (("layer_types", layer_types), ("mlp_layer_types", mlp_types)):
            if len(types) < layers:
                bad(f"{name} has {len(types)} entries for num_hidden_layers={layers}")
        head_dim = v["head_dim"]
        rope_dim = v["qk_rope_head_dim"]
        if rope_dim is None:
            factor = v["partial_rotary_factor"] if v["partial_rotary_factor"] is not None else 64 / 512
            rope_dim = int(head_dim * factor)
        main_theta, compress = _ropes(cfg, v["rope_theta"], v["compress_rope_theta"], source)
        eos = v["eos_token_id"]
        config = cls(
            vocab_size=v["vocab_size"],
            hidden_size=v["hidden_size"],
            num_hidden_layers=layers,
            num_attention_heads=v["num_attention_heads"],
            head_dim=head_dim,
            qk_rope_head_dim=rope_dim,
            q_lora_rank=v["q_lora_rank"],
            o_groups=v["o_groups"],
            o_lora_rank=v["o_lora_rank"],
            sliding_window=v["sliding_window"],
            layer_types=tuple(layer_types[:layers]),
            compress_rates={CSA: rates[CSA], HCA: rates[HCA]},
            index_n_heads=v["index_n_heads"],
            index_head_dim=v["index_head_dim"],
            index_topk=v["index_topk"],
            hc_mult=v["hc_mult"],
            hc_sinkhorn_iters=v["hc_sinkhorn_iters"],
            hc_eps=float(v["hc_eps"]),
            mlp_layer_types=tuple(mlp_types[:layers]),
            n_routed_experts=v["n_routed_experts"],
            n_shared_experts=v["n_shared_experts"],
            num_experts_per_tok=v["num_experts_per_tok"],
            moe_intermediate_size=v["moe_intermediate_size"],
            scoring_func=v["scoring_func"],
            norm_topk_prob=v["norm_topk_prob"],
            routed_scaling_factor=float(v["routed_scaling_factor"]),
            swiglu_limit=float(v["swiglu_limit"]),
            rms_norm_eps=float(v["rms_norm_eps"]),
            rope_theta=main_theta,
            compress_rope=compress,
            max_position_embeddings=v["max_position_embeddings"],
            tie_word_embeddings=v["tie_word_embeddings"],
            num_nextn_predict_layers=v["num_nextn_predict_layers"],
            quantization=_quantization(cfg, source),
            bos_token_id=v["bos_token_id"],
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            raw=dict(cfg),
        )
        config._check(bad)
        return config

    def _check(self, bad) -> None:
        """Relations between fields (each field's own type and range are FIELDS')."""
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.head_dim:
            bad(f"the rope width {self.qk_rope_head_dim} (head_dim x partial_rotary_factor) must be even and in (0, head_dim={self.head_dim}]")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            bad(f"o_groups={self.o_groups} does not divide num_attention_heads x head_dim = {self.num_attention_heads * self.head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            bad(f"index_head_dim={self.index_head_dim} is narrower than the rope width {self.qk_rope_head_dim}")
        if CSA in self.layer_types and self.compress_rates[CSA] < 1:
            bad("compress_rates.compressed_sparse_attention must be >= 1")
        if self.num_nextn_predict_layers > self.num_hidden_layers:
            bad(f"num_nextn_predict_layers={self.num_nextn_predict_layers} exceeds num_hidden_layers={self.num_hidden_layers}")
        if not self.num_experts_per_tok <= self.n_routed_experts:
            bad(f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}")
        if self.bos_token_id is not None and self.bos_token_id >= self.vocab_size:
            bad(f"bos_token_id={self.bos_token_id} is not below vocab_size={self.vocab_size}")
        for eos in self.eos_token_ids:
            if eos >= self.vocab_size:
                bad(f"eos_token_id {eos} is not below vocab_size={self.vocab_size}")


FIELDS = (
    Field("model_type", one_of(MODEL_TYPE), REQUIRED),
    Field("vocab_size", integer(min=1), REQUIRED),
    Field("hidden_size", integer(min=1), REQUIRED),
    Field("num_hidden_layers", integer(min=1), REQUIRED),
    Field("num_attention_heads", integer(min=1), REQUIRED),
    Field("num_key_value_heads", Kind("1 (V4 shares one KV head)", lambda v: v == 1 and not isinstance(v, bool)), 1),
    Field("head_dim", integer(min=2), REQUIRED),
    Field("qk_rope_head_dim", integer(min=2)),
    Field("partial_rotary_factor", number(above=0)),
    Field("q_lora_rank", integer(min=1), REQUIRED),
    Field("o_groups", integer(min=1), REQUIRED),
    Field("o_lora_rank", integer(min=1), REQUIRED),
    Field("sliding_window", integer(min=1, max=MAX_SLIDING_WINDOW), REQUIRED),
    Field("layer_types", _string_list(LAYER_TYPES)),
    Field("compress_ratios", integers(min=0)),
    Field("compress_rate_csa", integer(min=1)),
    Field("compress_rate_hca", integer(min=1)),
    Field("index_n_heads", integer(min=1), REQUIRED),
    Field("index_head_dim", integer(min=2), REQUIRED),
    Field("index_topk", integer(min=1, max=MAX_INDEX_TOPK), REQUIRED),
    Field("hc_mult", integer(min=1), 4),
    Field("hc_sinkhorn_iters", integer(min=1, max=MAX_SINKHORN_ITERS), 20),
    Field("hc_eps", number(above=0), 1e-6),
    Field("mlp_layer_types", _string_list((HASH_MOE, MOE))),
    Field("num_hash_layers", integer(min=0)),
    Field("n_routed_experts", integer(min=1), REQUIRED),
    Field("n_shared_experts", integer(min=0), 1),
    Field("num_experts_per_tok", integer(min=1), REQUIRED),
    Field("moe_intermediate_size", integer(min=1), REQUIRED),
    Field("scoring_func", one_of("sqrtsoftplus", "sigmoid", "softmax"), "sqrtsoftplus"),
    Field("norm_topk_prob", BOOLEAN, True),
    Field("routed_scaling_factor", number(above=0), 1.0),
    Field("swiglu_limit", number(above=0, max=FLOAT32_MAX), 10.0),
    Field("rms_norm_eps", number(above=0), 1e-6),
    Field("rope_theta", number(above=1), 10000.0),
    Field("compress_rope_theta", number(above=1), 160000.0),
    Field("max_position_embeddings", integer(min=2), REQUIRED),
    Field("tie_word_embeddings", BOOLEAN, False),
    Field("num_nextn_predict_layers", integer(min=0), 0),
    Field("bos_token_id", integer(min=0)),
    Field("eos_token_id", integers(min=0)),
    Field("hidden_act", one_of("silu"), "silu"),
    Field("attention_bias", Kind("false", lambda v: v is False), False),
    Field("mlp_bias", Kind("false", lambda v: v is False), False),
    Field("deepinfer_dummy_weights", BOOLEAN, False),
)
ROPE_FIELDS = (
    Field("rope_theta", number(above=1)),
    Field("rope_type", one_of(*ROPE_TYPES)),
    Field("type", one_of(*ROPE_TYPES)),
    Field("factor", number(above=0)),
    Field("original_max_position_embeddings", integer(min=1)),
    Field("beta_fast", number(above=0)),
    Field("beta_slow", number(above=0)),
    Field("attention_factor", number(above=0)),
    Field("partial_rotary_factor", number(above=0)),
)
QUANT_FIELDS = (
    Field("quant_method", one_of("fp8"), REQUIRED),
    Field("fmt", one_of("e4m3"), "e4m3"),
    Field("scale_fmt", one_of("ue8m0", "float32")),
    Field("weight_block_size", Kind("[128, 128]", lambda v: v == [128, 128]), [128, 128]),
    Field("activation_scheme", one_of("dynamic"), "dynamic"),
    Field("expert_dtype", one_of("fp4", "fp8", "bf16")),
)


def _ropes(cfg: Mapping[str, Any], main_theta: float, compress_theta: float, source: str) -> tuple[float, dict]:
    """(the sliding layers' rope base, the compressed branches' rope: base and YaRN keys).

    transformers nests `rope_parameters` as {"main": ..., "compress": ...}; a flat dict (or
    `rope_scaling`) is the compressed branches' scaling, as transformers folds it: YaRN applies only
    to layers with a compressor, and its attention factor is 1 (V4's reference does not scale cos/sin)."""
    params = check_object(cfg.get("rope_parameters"), "rope_parameters", source) or check_object(cfg.get("rope_scaling"), "rope_scaling", source) or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main = check_fields(params["main"], ROPE_FIELDS, source, where="rope_parameters.main.")
        if (main["rope_type"] or main["type"] or "default") != "default":
            raise CheckpointError(f"{source}: rope_parameters.main must be plain RoPE (V4 scales only the compressed branches)")
        main_theta = main["rope_theta"] or main_theta
        compress, where = params["compress"], "rope_parameters.compress."
    else:
        compress, where = {k: val for k, val in params.items() if k not in ("main", "compress")}, "rope_parameters."
    c = check_fields(compress, ROPE_FIELDS, source, where=where)
    kind = c["rope_type"] or c["type"] or "default"
    rope = {"rope_theta": float(c["rope_theta"] or compress_theta)}
    if kind == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            if c[key] is None:
                raise CheckpointError(f"{source}: {where}{key} is required for yarn rope scaling")
        rope.update({k: c[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow") if c[k] is not None})
        rope.update(rope_type="yarn", attention_factor=float(c["attention_factor"] or 1.0))
    return float(main_theta), rope


def _quantization(cfg: Mapping[str, Any], source: str) -> dict | None:
    qc = check_object(cfg.get("quantization_config"), "quantization_config", source)
    if qc is None:
        return None
    v = check_fields(qc, QUANT_FIELDS, source, where="quantization_config.")
    expert = v["expert_dtype"] or cfg.get("expert_dtype")
    return {"fmt": v["fmt"], "scale_fmt": v["scale_fmt"], "expert_dtype": expert}


__all__ = ["V4Config", "MODEL_TYPE", "SLIDING", "CSA", "HCA", "HASH_MOE", "MOE"]
