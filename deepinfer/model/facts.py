"""A checkpoint's ModelFacts: what every call the model makes to the gate and the attention ops looks
like, so that kernels serving only some models (the ascend backend's torch_npu fast paths) are
chosen, or not, when the ops are resolved, never per call."""

from __future__ import annotations

from pathlib import Path

from deepinfer.model.config import ModelConfig
from deepinfer.model.errors import LoadError
from deepinfer.registry import ModelFacts


def model_facts(config: ModelConfig) -> ModelFacts:
    """The facts of a DeepSeek V2/V3 model: its routing (deepinfer.model.moe passes these to `gate`)
    and its MLA head sizes (deepinfer.model.attention); no sliding window. DeepSeek-V4: its routing
    (sqrt-softplus scores with a bias, no groups) and its shared-KV heads and window; DeepSeek-V4.1
    routes and attends alike."""
    if config.model_type in ("deepseek_v4", "deepseek_v41"):
        return ModelFacts(
            model_type=config.model_type,
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
            score_func=config.scoring_func,
            n_group=1,
            topk_group=1,
            renormalize=True,
            correction_bias=True,
            num_heads=config.num_attention_heads,
            sliding_window=config.sliding_window,
        )
    n_group, topk_group = config.routing_groups
    return ModelFacts(
        model_type=config.model_type,
        num_experts=config.n_routed_experts or None,
        top_k=config.num_experts_per_tok,
        score_func=config.scoring_func,
        n_group=n_group,
        topk_group=topk_group,
        renormalize=config.norm_topk_prob,
        correction_bias=config.uses_correction_bias,
        num_heads=config.num_attention_heads,
        kv_lora_rank=config.kv_lora_rank,
        qk_rope_head_dim=config.qk_rope_head_dim,
        qk_head_dim=config.qk_head_dim,
        v_head_dim=config.v_head_dim,
        sliding_window=0,
    )


def checkpoint_facts(path: str | None) -> ModelFacts | None:
    """The facts of the checkpoint folder `path` (None: the embedded default), from its config.json.
    None when it cannot be read: `load_model` then reports why, in its own words."""
    from deepinfer.model.loader import load_config

    try:
        from deepinfer.model.embedded import ensure_embedded, resolve_model

        path, embedded = resolve_model(path)
        folder = ensure_embedded(alias=embedded) if embedded is not None else Path(path).expanduser()
        return model_facts(load_config(folder)) if folder.is_dir() else None
    except LoadError:
        return None
