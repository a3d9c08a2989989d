"""The model `bench prefix-reuse` runs, built the same way in both of its processes (the measuring one and the
restart one, `prefix_reuse_restart`): a random DeepSeek-V2-Lite-shaped model (`bench e2e`'s, built by transformers
from seed 0: e2e.build_v2_lite) or a random DeepSeek-V4-Flash-shaped one (e2e_v4.build_model: fp8_block
projections, mxfp4 experts, seed e2e_v4.SEED), cut to `layers`. Same shape, same seed: the same weights, so the
KV one process wrote to the disk tier is the KV the other would compute (the in-memory model's tier keys name its
config, not its weights: `weights_digest` lets the parent check that the child built the very same ones).

DeepSeek-V4.1 is refused in one line: this benchmark does not build its shape yet (the tiers run V4.1: tests/kv_tiers).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

from deepinfer.errors import UserError

MODEL_SHAPES = ("v2-lite", "v4-flash", "v41-flash")
NO_TIERS = {"v41-flash": "this benchmark does not build the DeepSeek-V4.1 shape yet (the KV tiers run V4.1, its state snapshots with its blocks)"}


@dataclass
class ModelSpec:
    """What both processes build: everything here goes through the JSON hand-off to the restart process."""

    shape: str = "v2-lite"
    backend: str = "reference"
    layers: int | None = None  # None: v2-lite all 27; v4-flash as many as fit (`build` picks, the child gets the count)
    deterministic: bool = True
    kv_cache_dtype: str | None = None  # None: the shape's default (v2-lite "auto", v4-flash "fp8")
    backend_options: dict = field(default_factory=dict)
    config_overrides: dict | None = None  # tests: a tiny shape

    def cache_dtype(self) -> str:
        return self.kv_cache_dtype or ("fp8" if self.shape == "v4-flash" else "auto")


@dataclass
class Built:
    runtime: object
    loaded: object
    dtype: object  # torch.dtype
    layers: int
    described: str  # one line: the shape, its layers, the dtypes


def check_shape(shape: str) -> None:
    if shape in NO_TIERS:
        raise UserError(f"--model-shape {shape}: {NO_TIERS[shape]}; bench prefix-reuse runs v2-lite or v4-flash")
    if shape not in MODEL_SHAPES:
        raise UserError(f"--model-shape must be one of {', '.join(s for s in MODEL_SHAPES if s not in NO_TIERS)}, not {shape!r}")


def max_positions(spec: ModelSpec) -> int:
    """The shape's positions (the workload's longest request must fit them)."""
    if spec.shape == "v4-flash":
        from deepinfer.bench.e2e_v4 import V4_FLASH

        return int({**V4_FLASH, **(spec.config_overrides or {})}["max_position_embeddings"])
    from deepinfer.bench.e2e import V2_LITE_LONG_CONTEXT

    return int({**V2_LITE_LONG_CONTEXT, **(spec.config_overrides or {})}["max_position_embeddings"])


def full_layers(spec: ModelSpec) -> int:
    from deepinfer.bench.e2e import V2_LITE
    from deepinfer.bench.e2e_v4 import V4_FLASH

    base = V4_FLASH if spec.shape == "v4-flash" else V2_LITE
    return int({**base, **(spec.config_overrides or {})}["num_hidden_layers"])


def vocab_size(spec: ModelSpec) -> int:
    from deepinfer.bench.e2e import V2_LITE
    from deepinfer.bench.e2e_v4 import V4_FLASH

    base = V4_FLASH if spec.shape == "v4-flash" else V2_LITE
    return int({**base, **(spec.config_overrides or {})}["vocab_size"])


def open_runtime_for(spec: ModelSpec, dtype, facts=None):
    """The runtime, in deterministic mode unless asked otherwise (every configuration's greedy tokens are compared)."""
    from deepinfer.bench.deterministic_runtime import open_deterministic_runtime

    return open_deterministic_runtime(
        spec.backend, dtype, spec.deterministic, "bench prefix-reuse runs in deterministic mode so that every configuration's greedy tokens can be compared",
        "measures with the backend's own kernels (outputs may then differ at near-ties, and are counted)", options=spec.backend_options, model=facts,
    )


def build(spec: ModelSpec, max_len: int, plan=None) -> Built:
    """The model of `spec` on its backend. max_len: the workload's longest request (V4's RoPE tables and plans).
    plan(block_size) -> (largest pool in blocks, max_num_seqs, max_num_batched_tokens): for v4-flash without
    `layers`, the engine the layer count must leave room for (the unbounded pool)."""
    import torch

    check_shape(spec.shape)
    if spec.shape == "v4-flash":
        return _build_v4(spec, max_len, plan)
    from deepinfer.bench.e2e import V2_LITE, V2_LITE_LONG_CONTEXT, build_v2_lite

    cfg = {**V2_LITE_LONG_CONTEXT, **(spec.config_overrides or {})}
    if spec.layers:
        cfg["num_hidden_layers"] = spec.layers
    runtime = open_runtime_for(spec, torch.bfloat16)
    loaded, hf = build_v2_lite(runtime, cfg)
    del hf  # deepinfer's model holds its own copies of what it needs (the experts stacked), the rest are views
    layers = cfg["num_hidden_layers"]
    return Built(runtime, loaded, torch.bfloat16, layers, f"V2-Lite shape, {layers} of {V2_LITE['num_hidden_layers']} layers, bf16")


def _build_v4(spec: ModelSpec, max_len: int, plan) -> Built:
    from deepinfer.bench import e2e_v4
    from deepinfer.engine.llm import resolve_dtype
    from deepinfer.model.facts import model_facts
    from deepinfer.ops import kv_cache_format
    from deepinfer.plugins import load_plugins

    full = e2e_v4.flash_config(overrides=spec.config_overrides)
    plugins = load_plugins()
    backend = plugins.auto()[0] if spec.backend == "auto" else plugins.backend(spec.backend)
    dtype = resolve_dtype("auto", backend.device(False))
    kv_dtype_name = spec.cache_dtype()
    facts = dataclasses.replace(model_facts(full), kv_cache_fp8=kv_dtype_name != "auto")
    runtime = open_runtime_for(spec, dtype, facts)
    layers = spec.layers
    if layers is None:
        block_size = int(runtime.backend.kv_block_size)
        blocks, seqs, chunk = plan(block_size) if plan is not None else (1, 1, 1)
        engine = e2e_v4.EnginePlan(blocks, seqs, prefill_tokens=min(chunk, seqs * max_len), longest=max_len)
        kv_dtype = kv_cache_format.cache_dtype(kv_dtype_name, dtype)

        def parts(n: int) -> dict[str, float]:
            return e2e_v4.memory_parts(e2e_v4.flash_config(n, spec.config_overrides), [engine], block_size, kv_dtype, dtype)

        layers = e2e_v4.choose_layers(parts, e2e_v4.free_memory(runtime.device, runtime.memory_info), None, runtime.device, full.num_hidden_layers,
                                      command="bench prefix-reuse --model-shape v4-flash",
                                      lower="--conversations / --prompt-len / --turns or --working-set-multiple")  # fmt: skip
    config = e2e_v4.flash_config(layers, spec.config_overrides)
    loaded = e2e_v4.build_model(config, runtime, dtype, max_len)
    described = f"V4-Flash shape, {layers} of {full.num_hidden_layers} layers, {str(dtype).removeprefix('torch.')}, KV cache {kv_dtype_name}"
    return Built(runtime, loaded, dtype, layers, described)


def weights_digest(model) -> str:
    """A short digest of the model's embedding and output head (their first 4096 values each): equal in two processes
    that built the same weights."""
    import torch

    digest = hashlib.blake2b(digest_size=8)
    for name in ("embed_tokens", "lm_head", "embed", "head"):
        tensor = getattr(model, name, None)
        if isinstance(tensor, torch.Tensor):
            digest.update(name.encode())
            digest.update(tensor.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return digest.hexdigest()
