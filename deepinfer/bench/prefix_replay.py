"""Bounded replay on a prefix-cache hit (DeepSeek-V4): what a hit costs as the cached prefix grows.

V4 pages the sliding-window KV of every token and the compressed entries, but each running sequence
also holds its compressors' open windows (a state slot), which the cache does not keep. A hit of P
tokens therefore recomputes the last `prefix_replay_tokens` of them (max(sliding window, 2 x CSA
ratio, HCA ratio): 128 for V4) to rebuild those windows, without rewriting their KV, then the new
tokens. The prefill work of a hit should be replay + new tokens, whatever P.

For each prefix length L: a random prompt of L tokens is run alone first (a full prefill, timed:
`fill_ms`; it fills the cache), then `repeat` requests of those L tokens + N fresh random ones each
(hits; the fastest counts: `hit_ms`). Times are to the first token (the prefill steps, sampling
included), taken by stepping the engine; `output_tokens` greedy tokens are generated after, untimed.
The prefill tokens are the engine's own count (`num_prompt_tokens_computed`, replay included). For
L up to `no_cache_max_len`, the first hit's request also runs on an engine without prefix caching
over the same loaded weights: its prefill tokens and time, and whether its greedy tokens are the
hit's (`identical`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from deepinfer.bench.device_api import device_name, host_cpu_name, on_host, synchronize


@dataclass
class ReplayResult:
    prefix_len: int
    new_tokens: int
    cached_tokens: int  # the hit: prompt tokens whose KV the cache held
    hit_prefill_tokens: int  # prompt tokens computed for the hit (replay + the uncached ones)
    hit_ms: float  # time to the first token of the hit, fastest of the repeats
    fill_ms: float  # time to the first token of the prefix alone (a full prefill)
    no_cache_prefill_tokens: int | None  # the same request without prefix caching (None: not run)
    no_cache_ms: float | None
    identical: bool | None  # the hit's greedy tokens equal the run without prefix caching
    output_tokens: list[int] = field(default_factory=list)  # the hit's greedy tokens
    hit_ms_all: list[float] = field(default_factory=list)


def timed_request(engine, prompt: list[int], params) -> tuple[float, int, list[int], int]:
    """Run one request alone on an idle engine: (seconds to its first token, prompt tokens computed,
    its output token ids, its cached tokens)."""
    assert not engine.has_unfinished(), "the engine must be idle"
    seq = engine.add_request(prompt, params)
    computed = engine.num_prompt_tokens_computed
    device = engine.runtime.device
    synchronize(device)
    start = time.perf_counter()
    while seq.num_output_tokens == 0:
        engine.step()
    synchronize(device)
    elapsed = time.perf_counter() - start
    prefill = engine.num_prompt_tokens_computed - computed
    while engine.has_unfinished():
        engine.step()
    return elapsed, prefill, list(seq.output_token_ids), seq.num_cached_tokens or 0


def machine_info(engine) -> dict:
    device = engine.runtime.device
    info = {"device": device_name(device), "torch": torch.__version__, "backend": engine.runtime.backend.name,
            "backend_options": dict(engine.runtime.options), "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    if on_host(device):
        info["cpu"] = host_cpu_name()
        info["cpu_threads"] = torch.get_num_threads()
    return info


def run(
    backend: str = "reference",
    model: str = "tiny-v4",
    prefix_lens=(1024, 8192, 32768),
    new_tokens: int = 16,
    output_tokens: int = 8,
    repeat: int = 3,
    no_cache_max_len: int | None = None,
    max_num_batched_tokens: int = 2048,
    dtype: str = "float32",
    seed: int = 0,
    json_path: Path | None = None,
    backend_options: dict[str, str] | None = None,
    cpu_threads: int | None = None,
) -> tuple[dict, list[ReplayResult]]:
    """no_cache_max_len: compare with a run without prefix caching for prefix lengths up to this
    (None: every one; 0: none). Returns (settings, results)."""
    from deepinfer.engine.block_manager import blocks_for
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
    from deepinfer.engine.sampling_params import SamplingParams

    longest = max(prefix_lens) + new_tokens + output_tokens
    # Loads the model; its engine (one KV block) is left unused: the block size is the backend's, known only now.
    base = LLM(model=model, backend=backend, dtype=dtype, max_num_seqs=1, max_num_batched_tokens=max_num_batched_tokens,
               num_kv_blocks=1, announce=False, backend_options=backend_options, cpu_threads=cpu_threads).engine  # fmt: skip
    num_blocks = blocks_for(longest, base.block_size)

    def new_engine(prefix_caching: bool) -> LLMEngine:
        config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=num_blocks, enable_prefix_caching=prefix_caching)
        return LLMEngine(base.loaded, base.runtime, base.dtype, config)

    cached, uncached = new_engine(True), None
    replay = cached.block_manager.prefix_replay_tokens
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(seed)

    def random_ids(n: int) -> list[int]:
        return torch.randint(0, cached.vocab_size, (n,), generator=gen).tolist()

    warm_up = random_ids(2 * replay + 16)
    timed_request(cached, warm_up, params)
    settings = {"model": model, "dtype": str(cached.dtype).removeprefix("torch."), "block_size": cached.block_size, "replay_tokens": replay,
                "new_tokens": new_tokens, "output_tokens": output_tokens, "repeat": repeat, "max_num_batched_tokens": max_num_batched_tokens,
                "no_cache_max_len": no_cache_max_len, "seed": seed}  # fmt: skip
    results = []
    for length in prefix_lens:
        prefix = random_ids(length)
        fill_s = timed_request(cached, prefix, params)[0]
        prompts = [prefix + random_ids(new_tokens) for _ in range(repeat)]  # each a hit on the same prefix: the same work
        hits = [timed_request(cached, prompt, params) for prompt in prompts]
        seconds, prefill, out, hit = hits[0]
        result = ReplayResult(length, new_tokens, hit, prefill, min(h[0] for h in hits) * 1e3, fill_s * 1e3, None, None, None,
                              out, [h[0] * 1e3 for h in hits])  # fmt: skip
        if no_cache_max_len is None or length <= no_cache_max_len:
            if uncached is None:
                uncached = new_engine(False)
                timed_request(uncached, warm_up, params)
            seconds, prefill, theirs, _ = timed_request(uncached, prompts[0], params)
            result.no_cache_prefill_tokens, result.no_cache_ms, result.identical = prefill, seconds * 1e3, theirs == out
        results.append(result)
    if json_path is not None:
        json_path.write_text(json.dumps({"machine": machine_info(cached), "settings": settings, "results": [asdict(r) for r in results]}, indent=1) + "\n")
    return settings, results


def format_results(settings: dict, results: list[ReplayResult]) -> str:
    lines = [
        f"replay {settings['replay_tokens']} tokens, {settings['new_tokens']} new tokens per hit; times to the first token",
        "  prefix  cached  hit tokens  hit ms  fill ms  no-cache tokens  no-cache ms  speedup  identical",
    ]
    for r in results:
        if r.no_cache_ms is None:
            peer = f"{'-':>15}  {'-':>11}  {'-':>7}  {'-':>9}"
        else:
            peer = f"{r.no_cache_prefill_tokens:15d}  {r.no_cache_ms:11.1f}  {r.no_cache_ms / r.hit_ms:6.1f}x  {str(r.identical).lower():>9}"
        lines.append(f"{r.prefix_len:8d}  {r.cached_tokens:6d}  {r.hit_prefill_tokens:10d}  {r.hit_ms:6.1f}  {r.fill_ms:7.1f}  {peer}")
    return "\n".join(lines)
