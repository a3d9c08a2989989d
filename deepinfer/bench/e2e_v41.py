"""End-to-end benchmark of a random DeepSeek-V4.1-Flash-shaped model (`deepinfer bench e2e --model-shape v41-flash`):
decode steps against their memory floor, prefills against their compute floor, and the cache bytes per token.

The model, its weights and its floors are deepinfer/bench/v41_flash.py's; the run follows V4's
(deepinfer/bench/e2e_v4.py) and reuses its pieces where the idea is the same: the layers kept are the most that
fit the device's free memory (`e2e_v4.choose_layers`) or `--layers`; decode requests start at their cache length
(`e2e_v4.admit_at_cache_length`: the prompt's first context - 1 tokens counted as computed, the state slot's
stored caches holding what they hold), one step computes the last prompt token, `warmup` untimed decode steps,
then `steps` timed ones; prefill rows (`e2e_v4.prefill_pass`) prefill random prompts from position 0 in chunks of
`prefill_chunk` tokens, one untimed pass then one timed. V4.1 keeps each sequence's history in the engine's token
blocks and the rest in a state slot (deepinfer/model/deepseek_v41/caches.py); the engine gets blocks for
max_num_seqs sequences of max_model_len tokens, so the memory plan counts that history and max_num_seqs slots;
the bounded replay is on (its default). Decode floors are bytes over the copy bandwidth and prefill floors FLOPs
over the bf16 matmul rate, both measured in the same run.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from deepinfer.bench import e2e_v4, v41_flash
from deepinfer.bench.device_api import device_name
from deepinfer.bench.e2e import MATMUL_HOW, GiB, copy_bandwidth, free_memory

COMMAND = "bench e2e --model-shape v41-flash"
SEED = 0


@dataclass
class V41Result:
    batch: int
    context: int
    steps: int
    step_ms: float
    floor_ms: float
    floor_bytes: float
    tok_s: float
    floor_parts: dict[str, float] = field(default_factory=dict)


@dataclass
class V41PrefillResult:
    batch: int
    prompt_len: int
    chunk_tokens: int
    steps: int
    seconds: float
    tok_s: float
    floor_s: float  # every part's FLOPs over the bf16 matmul rate
    of_floor: float
    flops: dict[str, float] = field(default_factory=dict)


def memory_parts(config, max_len: int, max_seqs: int, prefill_tokens: int, dtype: torch.dtype, copy_gib: float, matmul_n: int) -> dict[str, float]:
    """Bytes the run holds at once, by part: the weights as kept; one layer's routed experts twice more (while the
    model stacks them); the larger engine's cache (max_seqs sequences of max_len positions: paged history, state slots) and the unpacked
    copy of one KV source's history per sequence a step reads (caches.py); a prefill step's activations (the streams
    and the larger of attention's and the MoE's temporaries per token, times e2e_v4.ACTIVATIONS_SLACK); the
    bandwidth and matmul tests; e2e_v4.ACTIVATIONS_GIB of headroom."""
    from deepinfer.model.deepseek_v41 import caches
    from deepinfer.model.deepseek_v41.tensors import v41_tensor_specs

    c, size = config, torch.empty((), dtype=dtype).element_size()
    weights = experts = 0
    for name, spec in v41_tensor_specs(c).items():
        kept = v41_flash.kept_bytes(spec, size)
        weights += kept
        if v41_flash.is_routed_expert(name) and name.startswith(f"layers.{c.num_hidden_layers - 1}."):
            experts += kept
    unpacked = max_seqs * max_len * (c.head_dim + c.index_head_dim) * size
    attention = 4 * c.num_attention_heads * c.head_dim * size
    moe = c.num_experts_per_tok * (2 * c.hidden_size + 3 * c.moe_intermediate_size) * size
    activations = prefill_tokens * (3 * c.hc_mult * c.hidden_size * size + max(attention, moe)) * e2e_v4.ACTIVATIONS_SLACK
    parts = {
        "weights": float(weights),
        "expert stacking": 2.0 * experts,
        "cache and state slots": float(max_seqs * (caches.fixed_bytes_per_request(c) + max_len * caches.history_bytes_per_token(c)) + unpacked),
        "prefill activations": float(activations),
        "bandwidth test": 2 * copy_gib * GiB,
        "matmul test": float(10 * matmul_n**2),
        "activations": e2e_v4.ACTIVATIONS_GIB * GiB,
    }
    return {name: value for name, value in parts.items() if value}


def _engine(loaded, runtime, dtype, max_seqs: int, chunk: int, max_len: int):
    from deepinfer.engine.block_manager import blocks_for
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine

    blocks = max_seqs * blocks_for(max_len, int(runtime.backend.kv_block_size))
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=chunk, num_kv_blocks=blocks, enable_prefix_caching=False,
                          max_model_len=max_len)  # fmt: skip
    return LLMEngine(loaded, runtime, dtype, config)


def run(
    backend: str = "auto",
    batches=(1, 64, 256),
    contexts=(4096, 32768),
    steps: int = 16,
    warmup: int = e2e_v4.WARMUP_STEPS,
    layers: int | None = None,
    json_path: Path | None = None,
    copy_gib: float = 2.0,
    backend_options: dict[str, str] | None = None,
    config_overrides: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
    progress: Callable[[str], None] | None = None,
    prefills=e2e_v4.DEFAULT_PREFILLS,
    prefill_chunk: int | None = None,
    matmul_n: int | None = None,
) -> tuple[list[V41Result], list[V41PrefillResult], dict]:
    """Build the model (cut to fit), time the decode rows (each (batch, context) pair) and the prefill rows (each
    (prompts, tokens) pair); returns them and the run's facts (layers, cache bytes, bandwidth, matmul rate...)."""
    from deepinfer.bench.e2e import matmul_rates, matmul_side
    from deepinfer.model.facts import model_facts
    from deepinfer.runtime import open_runtime

    say = progress or (lambda line: print(f"deepinfer: {line}", file=sys.stderr, flush=True))
    full = v41_flash.flash_config(overrides=config_overrides)
    runtime = open_runtime(backend, dtype=dtype, options=backend_options, model=model_facts(full))
    device = runtime.device
    if prefill_chunk is None:  # the engine's default on this device
        from deepinfer.engine.step_budget import default_max_num_batched_tokens

        prefill_chunk = default_max_num_batched_tokens(device)
    decode_len = e2e_v4.model_len(contexts, steps, warmup) if batches else 0
    prefill_len = max((length for _, length in prefills), default=0) + 1
    max_len = max(decode_len, prefill_len)
    max_seqs = max([*batches, *(b for b, _ in prefills)])
    prefill_tokens = min(prefill_chunk, max((b * length for b, length in prefills), default=0))
    matmul_n = matmul_side(device, matmul_n) if prefills else 0

    def plan(n: int) -> dict[str, float]:
        return memory_parts(v41_flash.flash_config(n, config_overrides), max_len, max_seqs, prefill_tokens, dtype, copy_gib if batches else 0.0, matmul_n)

    n_layers = e2e_v4.choose_layers(plan, free_memory(device, runtime.memory_info), layers, device, full.num_hidden_layers, command=COMMAND)
    config = v41_flash.flash_config(n_layers, config_overrides)
    kinds = v41_flash.layer_kinds(config)
    say(f"V4.1-Flash shape cut to {n_layers} of {full.num_hidden_layers} layers ({', '.join(f'{n} {k}' for k, n in kinds.items())}); "
        f"{sum(plan(n_layers).values()) / GiB:.1f} GiB planned on {device}")  # fmt: skip
    loaded = v41_flash.build_model(config, runtime, dtype, max_len, SEED)
    info = {
        "gpu": device_name(device), "torch": torch.__version__, "backend": runtime.backend.name, "backend_options": dict(runtime.options),
        "layers": n_layers, "of_layers": full.num_hidden_layers, "layer_roles": kinds, "dtype": str(dtype).removeprefix("torch."),
        "cache": {"kept_layers": v41_flash.cache_bytes(config), "all_layers": v41_flash.cache_bytes(full)},
        "cache_formats": "window rows fp8 e4m3 + e8m0 per 32, compressed KV nvfp4, index keys mxfp4 (deepinfer/ops/cache_storage.py)",
        "weights": "routed experts mxfp4 packed; projections and Engram rows decoded to the model dtype; see deepinfer/bench/v41_flash.py",
        "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    results, prefill_results = [], []

    def save() -> None:
        if json_path is not None:
            data = {"machine": info, "results": [asdict(r) for r in results], "prefill": [asdict(r) for r in prefill_results]}
            json_path.write_text(json.dumps(data, indent=1))

    size = torch.empty((), dtype=dtype).element_size()
    if batches:
        bandwidth = copy_bandwidth(device, copy_gib)
        info["copy_bandwidth_tb_s"] = bandwidth / 1e12
        results = _decode_rows(loaded, runtime, dtype, config, batches, contexts, steps, warmup, decode_len, size, bandwidth, say)
        save()
    if prefills:
        rates = matmul_rates(device, matmul_n)
        info["matmul_tflops_bf16"], info["matmul_how"] = rates.bf16 / 1e12, f"{MATMUL_HOW}; n = {rates.n}"
        info["prefill_chunk_tokens"] = prefill_chunk
        prefill_results = _prefill_rows(loaded, runtime, dtype, config, prefills, prefill_chunk, prefill_len, rates.bf16, say)
        save()
    return results, prefill_results, info


def _decode_rows(loaded, runtime, dtype, config, batches, contexts, steps, warmup, max_len, size, bandwidth, say) -> list[V41Result]:
    from deepinfer.engine.sampling_params import SamplingParams

    device = runtime.device
    engine = _engine(loaded, runtime, dtype, max(batches), max(batches), max_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_len - 1 - max(contexts), ignore_eos=True)
    tokens = torch.Generator().manual_seed(SEED + 2)
    results = []
    for context in contexts:
        base = torch.randint(0, config.vocab_size, (context - 1,), generator=tokens).tolist()
        for batch in batches:
            for token in torch.randint(0, config.vocab_size, (batch,), generator=tokens).tolist():
                e2e_v4.admit_at_cache_length(engine, base + [token], params)
            step = e2e_v4.timed_decode_steps(engine, device, warmup, steps)
            engine.abort_all()
            parts = v41_flash.floor_parts(config, batch, context + warmup + steps // 2, size)
            floor = sum(parts.values())
            results.append(V41Result(batch, context, steps, step * 1e3, floor / bandwidth * 1e3, floor, batch / step, parts))
            say(f"batch {batch} context {context}: {step * 1e3:.2f} ms per step")
    return results


def _prefill_rows(loaded, runtime, dtype, config, prefills, chunk, max_len, bf16_rate, say) -> list[V41PrefillResult]:
    import gc

    from deepinfer.bench.device_api import empty_cache

    device = runtime.device
    gc.collect()  # the decode rows' engine (its state slots) freed before this one is built
    empty_cache(device)
    engine = _engine(loaded, runtime, dtype, max(b for b, _ in prefills), chunk, max_len)
    tokens = torch.Generator().manual_seed(SEED + 3)
    results = []
    for batch, prompt_len in prefills:
        e2e_v4.prefill_pass(engine, batch, prompt_len, tokens, device)  # untimed
        seconds, steps, computed = e2e_v4.prefill_pass(engine, batch, prompt_len, tokens, device)
        if computed != batch * prompt_len:
            raise RuntimeError(f"prefill {batch} x {prompt_len}: the engine computed {computed} prompt tokens, not {batch * prompt_len}; the timing is void")
        flops = v41_flash.prefill_flops(config, batch, prompt_len)
        floor = sum(flops.values()) / bf16_rate
        results.append(V41PrefillResult(batch, prompt_len, chunk, steps, seconds, batch * prompt_len / seconds, floor, floor / seconds, flops))
        say(f"prefill {batch} x {prompt_len}: {seconds:.3f} s in {steps} steps (floor {floor:.3f} s)")
    return results


def format_results(results: list[V41Result], info: dict, prefill: list[V41PrefillResult] = ()) -> str:
    roles = ", ".join(f"{n} {k}" for k, n in info["layer_roles"].items())
    kept, whole = info["cache"]["kept_layers"], info["cache"]["all_layers"]
    lines = [
        f"{info['layers']} of {info['of_layers']} layers ({roles}); {info['cache_formats']}",
        f"cache held: {kept['history_bytes_per_token']:.6g} B per token of history + {kept['fixed_bytes_per_request']} B per request (fixed) "
        f"for these layers; all {info['of_layers']} layers: {whole['history_bytes_per_token']:.6g} B per token + {whole['fixed_bytes_per_request']} B",
    ]
    if results:
        lines += [f"decode: copy bandwidth {info['copy_bandwidth_tb_s']:.3f} TB/s; floor = bytes read / copy bandwidth, for these layers",
                  "batch  context  ms/step  floor ms  of floor    tok/s  floor GB: dense  experts  cache"]  # fmt: skip
    for r in results:
        p = {k: v / 1e9 for k, v in r.floor_parts.items()}
        lines.append(f"{r.batch:5d}  {r.context:7d}  {r.step_ms:7.2f}  {r.floor_ms:8.2f}  {r.floor_ms / r.step_ms:8.0%}  {r.tok_s:7.0f}"
                     f"  {p['dense weights']:15.2f}  {p['routed experts']:7.2f}  {p['cache']:5.2f}")  # fmt: skip
    if prefill:
        lines += [f"prefill: matmul bf16 {info['matmul_tflops_bf16']:.1f} TFLOP/s; floor = FLOPs / that rate, for these layers; "
                  f"chunks of {info['prefill_chunk_tokens']} tokens", "prompts x tokens  steps  seconds     tok/s  floor s  of floor  TFLOP"]  # fmt: skip
    for r in prefill:
        lines.append(f"{f'{r.batch} x {r.prompt_len}':>16}  {r.steps:5d}  {r.seconds:7.3f}  {r.tok_s:8.0f}  {r.floor_s:7.3f}  {r.of_floor:8.0%}"
                     f"  {sum(r.flops.values()) / 1e12:5.2f}")  # fmt: skip
    return "\n".join(lines)
