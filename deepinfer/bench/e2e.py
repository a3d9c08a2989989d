"""End-to-end decode benchmark: deepinfer against HF transformers' `generate` on the same weights.

A random-weight DeepSeek-V2-Lite-shaped model (27 layers, hidden 2048, 64 experts top-6, 2 shared,
MLA with kv_lora 512, bf16) is built once by transformers on the device; deepinfer runs the very
same tensors (no disk round trip). For each batch size it measures the decode step time of both
(generation of N+1 tokens minus generation of 1 token, over N) and compares deepinfer's with the
floor: bytes a decode step must read (weights touched + KV cache) over the copy bandwidth measured
in the same run.

Nothing here is CUDA-specific: the backend's device is where both models live, synchronisation goes
through torch.accelerator, and before anything is built the memory the run needs is checked against
what the device has free (one line naming both when it does not fit).

The machine's ceilings that the benchmarks' floors divide by are measured here, in the run that uses
them, through torch's device-generic ops: `copy_bandwidth` (a device-to-device copy) and `matmul_rates`
(bf16 `torch.matmul` and fp8 `torch._scaled_mm` products; the V4 prefill's compute floor,
deepinfer/bench/v4_prefill_floor.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from deepinfer.bench.device_api import device_name, synchronize
from deepinfer.errors import UserError

GiB = 1 << 30
ENGINE_KV_CACHE_GIB = 8.0  # the KV cache budget deepinfer's engine gets (it takes less when less is enough)

V2_LITE = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
    n_routed_experts=64, routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy", n_group=1,
    topk_group=1, num_experts_per_tok=6, moe_layer_freq=1, first_k_dense_replace=1,
    norm_topk_prob=False, scoring_func="softmax", max_position_embeddings=4096, rope_theta=10000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001,
)
# The released checkpoint's long-context positions (YaRN from the 4096 it was trained at), for workloads past 4096
# tokens (bench prefix-reuse's 32k-token prompts); the decode benches keep 4096 (their KV sizing reads it).
V2_LITE_LONG_CONTEXT = dict(
    V2_LITE, max_position_embeddings=163840,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                  "mscale": 0.707, "mscale_all_dim": 0.707},
)  # fmt: skip


@dataclass
class E2EResult:
    batch: int
    prompt_len: int
    new_tokens: int
    deepinfer_step_ms: float
    hf_step_ms: float | None
    floor_ms: float
    floor_bytes: float
    deepinfer_tok_s: float
    hf_tok_s: float | None
    profile: dict | None = None  # `--profile`: time per decode step by kernel (deepinfer/bench/step_profile.py)


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus written (median of 10)."""
    n = int(gib * 2**30) // 2
    src, dst = torch.empty(n, dtype=torch.bfloat16, device=device), torch.empty(n, dtype=torch.bfloat16, device=device)
    src.normal_()
    times = [_timed(lambda: dst.copy_(src), device) for _ in range(13)][3:]
    return 2 * n * 2 / sorted(times)[len(times) // 2]


@dataclass
class MatmulRates:
    """FLOP/s of square n x n x n products on a device, measured by `matmul_rates`."""

    n: int
    bf16: float
    fp8: float | None  # None: the device has no fp8 product to measure (fp8_missing says why)
    fp8_missing: str | None = None

    def for_floor(self) -> dict[str, float]:
        """The rate of each format class ("bf16", "fp8"); fp8 at the bf16 rate where it could not be measured."""
        return {"bf16": self.bf16, "fp8": self.bf16 if self.fp8 is None else self.fp8}


MATMUL_HOW = "n x n x n products, median of 10: bf16 by torch.matmul; fp8 by torch._scaled_mm (e4m3 x e4m3 -> bf16, per-tensor scales)"
DEVICE_MATMUL_N, HOST_MATMUL_N = 8192, 1024  # the host's (CPU) smaller: its rate is a yardstick, and 8192 takes minutes there


def matmul_rates(device: torch.device, n: int | None = None) -> MatmulRates:
    """The device's bf16 and fp8 matmul rates (FLOP/s, 2 n^3 per product) through torch's device-generic
    ops, as copy_bandwidth measures the copy: the ceilings a compute-bound step is held against. n: the
    side (default DEVICE_MATMUL_N, HOST_MATMUL_N on the CPU). fp8 is None, with the reason, on the host
    (torch's CPU fp8 product is an emulation thousands of times slower than its bf16 one, and the
    reference backend runs fp8 weights dequantised) and on a device without torch._scaled_mm."""
    from deepinfer.bench import device_api
    from deepinfer.ops.quant import FP8_DTYPE

    host = device_api.on_host(device)
    n = matmul_side(device, n)
    flops = 2.0 * n**3
    a, b = torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    bf16 = flops / _median_time(lambda: torch.matmul(a, b, out=out), device)
    if host:
        return MatmulRates(n, bf16, None, "the host has no fp8 product (the reference backend runs fp8 weights dequantised)")
    a8, b8 = a.to(FP8_DTYPE), b.to(FP8_DTYPE)
    one = torch.ones((), device=device, dtype=torch.float32)
    try:  # the second operand column-major, as the fp8 GEMMs of cuBLAS want it
        fp8 = flops / _median_time(lambda: torch._scaled_mm(a8, b8.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), device)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return MatmulRates(n, bf16, None, f"torch._scaled_mm failed on {device}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    return MatmulRates(n, bf16, fp8)


def matmul_side(device: torch.device, n: int | None = None) -> int:
    """The side of `matmul_rates`' products on `device`: n, or by default DEVICE_MATMUL_N (HOST_MATMUL_N on the CPU)."""
    from deepinfer.bench.device_api import on_host

    return n or (HOST_MATMUL_N if on_host(device) else DEVICE_MATMUL_N)


def _median_time(fn, device: torch.device, runs: int = 10, warmup: int = 3) -> float:
    times = [_timed(fn, device) for _ in range(warmup + runs)][warmup:]
    return sorted(times)[len(times) // 2]


def hf_to_deepinfer_tensors(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """transformers 5 keeps experts fused in memory ([E, 2I, H] gate_up, [E, H, I] down); deepinfer's
    loader takes the checkpoint names, one tensor per expert (views, no copies)."""
    out = {}
    inter = config["moe_intermediate_size"]
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        elif name.endswith("mlp.gate.weight"):
            out[name] = t.float()  # the router runs in float32
        else:
            out[name] = t
    return out


def _attention_weights(config: dict) -> int:
    """Weights of one MLA attention block (no q LoRA): q, kv_a, kv_b and o projections."""
    h = config["hidden_size"]
    heads, nope, rope = config["num_attention_heads"], config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    vd, c = config["v_head_dim"], config["kv_lora_rank"]
    return h * heads * (nope + rope) + h * (c + rope) + c * heads * (nope + vd) + heads * vd * h


def decode_floor_bytes(config: dict, batch: int, context: int, dtype_bytes: int = 2) -> float:
    """Bytes one decode step must read: every weight it touches once, plus the KV cache.

    Routed experts touched per MoE layer: with near-uniform routing (random weights), the expected
    number of distinct experts among batch*top_k draws, E * (1 - (1 - k/E)^batch).
    """
    h, v = config["hidden_size"], config["vocab_size"]
    rope, c = config["qk_rope_head_dim"], config["kv_lora_rank"]
    attn = _attention_weights(config)
    expert = 3 * h * config["moe_intermediate_size"]
    e, k = config["n_routed_experts"], config["num_experts_per_tok"]
    touched = e * (1 - (1 - k / e) ** batch)
    layers, dense = config["num_hidden_layers"], config["first_k_dense_replace"]
    moe_layer = expert * (touched + config["n_shared_experts"]) + e * h
    weights = layers * attn + dense * 3 * h * config["intermediate_size"] + (layers - dense) * moe_layer + h * v + batch * h
    kv = batch * context * (c + rope) * layers
    return float((weights + kv) * dtype_bytes)


def memory_needed(config: dict, max_batch: int, prompt_len: int, new_tokens: int, with_hf: bool, copy_gib: float, dtype_bytes: int = 2) -> dict[str, float]:
    """Bytes the run holds at once on the device, by part (a lower bound: activations are left out).

    transformers' weights are counted once: deepinfer runs those very tensors, except the routed
    experts, which it stacks into one tensor per layer (a copy). deepinfer's KV cache is what the
    engine takes (ENGINE_KV_CACHE_GIB, less when its longest sequences need less); transformers'
    cache holds every head's decompressed keys and values; the bandwidth test holds two buffers of
    copy_gib.
    """
    h, v, layers, dense = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"], config["first_k_dense_replace"]
    e, shared = config["n_routed_experts"], config["n_shared_experts"]
    moe_layers = max(layers - dense, 0)
    expert = 3 * h * config["moe_intermediate_size"]
    dense_mlps = min(dense, layers) * 3 * h * config["intermediate_size"]
    weights = layers * _attention_weights(config) + dense_mlps + moe_layers * (expert * (e + shared) + e * h) + 2 * h * v
    latent = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * layers * dtype_bytes  # per token
    parts = {
        "weights": float(weights * dtype_bytes),
        "stacked experts": float(moe_layers * e * expert * dtype_bytes),
        "KV cache": float(min(ENGINE_KV_CACHE_GIB * GiB, max_batch * config["max_position_embeddings"] * latent)),
        "bandwidth test": 2 * copy_gib * GiB,
    }
    if with_hf:
        heads = config["num_attention_heads"]
        per_token = heads * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"] + config["v_head_dim"]) * layers * dtype_bytes
        parts["HF KV cache"] = float(max_batch * (prompt_len + new_tokens + 1) * per_token)
    return parts


def free_memory(device: torch.device, memory_info) -> int | None:
    """Bytes free on the device, from the backend's `memory_info` capability ((free, total) bytes);
    the host's available RAM when the backend has none (the CPU); None when neither can be told."""
    if memory_info is not None:
        return int(memory_info(device)[0])
    from deepinfer.model.memory import host_available

    return host_available()


def check_fits(parts: dict[str, float], free: int | None, device: torch.device, layers: int) -> None:
    """Refuse, in one line, a run that cannot fit the device's free memory (before anything is allocated)."""
    need = sum(parts.values())
    if free is None or need <= free:
        return
    detail = ", ".join(f"{name} {value / GiB:.1f}" for name, value in parts.items())
    raise UserError(
        f"bench e2e needs at least {need / GiB:.1f} GiB on {device} ({detail}) and {free / GiB:.1f} GiB is free; "
        f"cut the {layers}-layer model with --layers, or run on a device with more memory"
    )


def _timed(fn, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def run(
    backend: str = "auto",
    batches=(1, 64),
    prompt_len: int = 128,
    new_tokens: int = 64,
    layers: int | None = None,
    with_hf: bool = True,
    json_path: Path | None = None,
    config_overrides: dict | None = None,
    copy_gib: float = 2.0,
    backend_options: dict[str, str] | None = None,
    deterministic: bool = False,
    overlap: bool | None = None,
    profile_rows: int = 0,
) -> list[E2EResult]:
    """backend_options: the backend's options for deepinfer's side (`bench e2e --backend-option`).
    deterministic: deepinfer's side in deterministic mode (batch-invariant kernels: its cost is this
    run's step time over the default mode's). overlap: LLM's (None: where the backend runs asynchronously).
    profile_rows: > 0 profiles deepinfer's decode step after its timing and keeps that many kernels
    (deepinfer/bench/step_profile.py)."""
    from deepinfer.runtime import open_runtime

    cfg = dict(V2_LITE, **(config_overrides or {}), **({"num_hidden_layers": layers} if layers else {}))
    runtime = open_runtime(backend, dtype=torch.bfloat16, options=backend_options, deterministic=deterministic)
    device = runtime.device
    needed = memory_needed(cfg, max(batches), prompt_len, new_tokens, with_hf, copy_gib)
    check_fits(needed, free_memory(device, runtime.memory_info), device, cfg["num_hidden_layers"])
    bandwidth = copy_bandwidth(device, copy_gib)
    loaded, hf = build_v2_lite(runtime, cfg)
    llm = bench_llm(loaded, runtime, max(batches), prompt_len, deterministic, overlap)
    results = []
    gen = torch.Generator().manual_seed(1)
    for batch in batches:
        prompts = random_prompts(cfg, batch, prompt_len, gen)

        def ours(n):
            return greedy(llm, prompts, n)

        # Warm-up runs both timed calls once: the first prefill over a cached prefix compiles its own
        # kernel variant and each batch size captures its own graphs; none of that may land in a timing.
        ours(1), ours(1 + new_tokens)
        # the fastest of a few runs: one run's step time wandered by +-10% between runs on the H200
        t1 = min(_timed(lambda: ours(1), device) for _ in range(3))
        tn = min(_timed(lambda: ours(1 + new_tokens), device) for _ in range(3))
        step = (tn - t1) / new_tokens
        if step <= 0:
            raise RuntimeError(
                f"batch {batch}: generating {1 + new_tokens} tokens took {tn * 1e3:.1f} ms, not more than 1 token's {t1 * 1e3:.1f} ms; the timing is void"
            )
        hf_step = None
        if with_hf:
            ids = prompts.to(device)

            def theirs(n):
                return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)

            with torch.inference_mode():
                theirs(1), theirs(1 + new_tokens)
                h1 = min(_timed(lambda: theirs(1), device) for _ in range(2))
                hn = _timed(lambda: theirs(1 + new_tokens), device)
            hf_step = (hn - h1) / new_tokens
        floor_bytes = decode_floor_bytes(cfg, batch, prompt_len + new_tokens // 2)
        profile = None
        if profile_rows > 0:
            from deepinfer.bench import step_profile

            profile = step_profile.difference(ours, new_tokens, device, runtime.profiler_activity).to_json(profile_rows)
        results.append(
            E2EResult(
                batch, prompt_len, new_tokens, step * 1e3, None if hf_step is None else hf_step * 1e3,
                floor_bytes / bandwidth * 1e3, floor_bytes, batch / step, None if hf_step is None else batch / hf_step, profile,
            )
        )
    if json_path is not None:
        info = {"gpu": device_name(device), "torch": torch.__version__, "copy_bandwidth_tb_s": bandwidth / 1e12, "layers": cfg["num_hidden_layers"],
                "backend": runtime.backend.name, "backend_options": dict(runtime.options), "deterministic": deterministic,
                "overlap": llm.engine.overlap is not None, "date": time.strftime("%Y-%m-%d")}
        json_path.write_text(json.dumps({"machine": info, "results": [asdict(r) for r in results]}, indent=1))
    return results


def bench_llm(loaded, runtime, max_batch: int, prompt_len: int, deterministic: bool = False, overlap: bool | None = None):
    """deepinfer's LLM over `loaded`, sized for `max_batch` prompts of `prompt_len` tokens in one step."""
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine

    engine_config = EngineConfig(max_num_seqs=max_batch, max_num_batched_tokens=max_batch * prompt_len, kv_cache_memory_gib=ENGINE_KV_CACHE_GIB,
                                 deterministic=deterministic, overlap=overlap)  # fmt: skip
    return LLM.from_engine(LLMEngine(loaded, runtime, torch.bfloat16, engine_config))


def random_prompts(cfg: dict, batch: int, prompt_len: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, cfg["vocab_size"], (batch, prompt_len), generator=gen)


def greedy(llm, prompts: torch.Tensor, new_tokens: int):
    """`new_tokens` greedy tokens for each prompt row, EOS ignored (every request runs every step)."""
    from deepinfer.engine.sampling_params import SamplingParams

    requests = [{"prompt_token_ids": p.tolist()} for p in prompts]
    return llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)


def build_v2_lite(runtime, cfg: dict):
    """The random V2-Lite-shaped model (config `cfg`, seed 0), built by transformers on the runtime's
    device, and deepinfer's model over the very same tensors: (LoadedModel, the HF model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from deepinfer.model.config import ModelConfig
    from deepinfer.model.deepseek import DeepseekForCausalLM
    from deepinfer.model.loader import LoadedModel
    from deepinfer.model.weights import WeightStore

    torch.manual_seed(0)
    hf_config = AutoConfig.for_model("deepseek_v2", **cfg)
    with torch.device(runtime.device):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    config = ModelConfig.from_dict({**hf_config.to_dict(), **cfg, "model_type": "deepseek_v2"}, source="V2-Lite-shaped random model")
    model = DeepseekForCausalLM(config, runtime.ops, runtime.device, torch.bfloat16)
    model.load_weights(WeightStore(hf_to_deepinfer_tensors(hf.state_dict(), cfg)))
    loaded = LoadedModel(model=model, config=config, tokenizer=None, path="in-memory DeepSeek-V2-Lite-shaped model", dummy_weights=True)
    return loaded, hf


def format_results(results: list[E2EResult]) -> str:
    lines = ["batch  deepinfer ms/step  floor ms  of floor  deepinfer tok/s  HF ms/step  HF tok/s  speedup"]
    for r in results:
        hf = f"{r.hf_step_ms:10.2f}  {r.hf_tok_s:8.0f}  {r.hf_step_ms / r.deepinfer_step_ms:6.2f}x" if r.hf_step_ms else "         -         -        -"
        lines.append(f"{r.batch:5d}  {r.deepinfer_step_ms:17.2f}  {r.floor_ms:8.2f}  {r.floor_ms / r.deepinfer_step_ms:7.0%}  {r.deepinfer_tok_s:15.0f}  {hf}")
    if any(r.profile for r in results):
        from deepinfer.bench.step_profile import format_profile

        lines += [format_profile(f"batch {r.batch}", r.profile, r.deepinfer_step_ms) for r in results if r.profile]
    return "\n".join(lines)
