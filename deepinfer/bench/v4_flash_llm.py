"""An LLM over the random DeepSeek-V4-Flash-shaped model, for `bench throughput`, `sweep` and `serve --model-shape v4-flash`.

The model is `bench e2e --model-shape v4-flash`'s (deepinfer/bench/e2e_v4.py builds it: fp8_block
projections, mxfp4 routed experts, weights drawn on the device; activations bf16 on accelerators),
with an FP8 KV cache, under an engine sized for the workload rather than for the config's 1M positions:
`max_model_len` is the workload's longest request (prompt and output; the callers compute it), since
a V4 decode step plans on the device over tables as wide as the block table allows (max_model_len /
ratio entries per sequence, deepinfer/model/deepseek_v4/decode_plan.py), and the KV cache holds
max_num_seqs such requests (one state slot each). The model keeps its first N layers: `layers`, or the
most whose weights, KV cache, state slots and largest prefill step's activations (max_num_batched_tokens
tokens) fit the device's free memory, by the rule bench e2e follows (e2e_v4.memory_parts, choose_layers).
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

LOWER = "--max-num-seqs / --input-len / --output-len (or --max-model-len)"  # the flags that shrink the engine's need


def random_flash_llm(backend: str, layers: int | None, engine_options: dict, *, command: str, config_overrides: dict | None = None,
                     dtype: str | torch.dtype = "auto", kv_cache_dtype: str = "fp8", progress: Callable[[str], None] | None = None):  # fmt: skip
    """The LLM; engine_options: EngineConfig's, `max_model_len` and `max_num_seqs` among them. `command`
    names the benchmark in the one-line error of a model that does not fit. dtype: the activations'
    ("auto": bfloat16 on accelerators, as bench e2e runs, float32 on the CPU; LLM's rule)."""
    import dataclasses

    from deepinfer.bench import e2e_v4
    from deepinfer.engine.block_manager import blocks_for
    from deepinfer.engine.llm import LLM, resolve_dtype
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
    from deepinfer.model.facts import model_facts
    from deepinfer.ops import kv_cache_format
    from deepinfer.plugins import load_plugins
    from deepinfer.runtime import open_runtime

    say = progress or (lambda line: print(f"deepinfer: {line}", file=sys.stderr, flush=True))
    max_len, max_seqs = engine_options["max_model_len"], engine_options["max_num_seqs"]
    full = e2e_v4.flash_config(overrides=config_overrides)
    plugins = load_plugins()
    spec = plugins.auto()[0] if backend == "auto" else plugins.backend(backend)
    dtype = resolve_dtype(dtype, spec.device(False))
    facts = dataclasses.replace(model_facts(full), kv_cache_fp8=kv_cache_dtype != "auto")
    runtime = open_runtime(backend, dtype=dtype, plugins=plugins, model=facts)
    device, block_size = runtime.device, int(runtime.backend.kv_block_size)
    kv_dtype = kv_cache_format.cache_dtype(kv_cache_dtype, dtype)
    num_blocks = max_seqs * blocks_for(max_len, block_size)
    chunk = engine_options.get("max_num_batched_tokens")
    if chunk is None:  # the engine's default on this device
        from deepinfer.engine.step_budget import default_max_num_batched_tokens

        chunk = default_max_num_batched_tokens(device)
    engine = e2e_v4.EnginePlan(num_blocks, max_seqs, prefill_tokens=min(chunk, max_seqs * max_len), longest=max_len)

    def plan(n: int) -> dict[str, float]:
        return e2e_v4.memory_parts(e2e_v4.flash_config(n, config_overrides), [engine], block_size, kv_dtype, dtype)

    n_layers = e2e_v4.choose_layers(plan, e2e_v4.free_memory(device, runtime.memory_info), layers, device, full.num_hidden_layers, command=command,
                                    lower=LOWER)  # fmt: skip
    config = e2e_v4.flash_config(n_layers, config_overrides)
    kinds = ", ".join(f"{n} {k}" for k, n in e2e_v4.layer_kinds(config).items())
    say(f"V4-Flash shape cut to {n_layers} of {full.num_hidden_layers} layers ({kinds}); max_model_len {max_len}; "
        f"{sum(plan(n_layers).values()) / e2e_v4.GiB:.1f} GiB planned on {device}")  # fmt: skip
    loaded = e2e_v4.build_model(config, runtime, dtype, max_len)
    engine_config = EngineConfig(**{**engine_options, "num_kv_blocks": num_blocks, "kv_cache_dtype": kv_cache_dtype})
    return LLM.from_engine(LLMEngine(loaded, runtime, dtype, engine_config))
