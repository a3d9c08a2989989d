"""Offline serving throughput, as vLLM's `bench throughput` measures it, with per-request latencies.

A workload is a list of requests (prompt token ids, output tokens): random prompts whose lengths are
drawn uniformly in [len x (1 - range_ratio), len x (1 + range_ratio)] (vLLM's random dataset), or
the prompts of a JSONL file. The engine runs them with at most `concurrency` requests in flight (a
finished request's place goes to the next one), sampling at temperature 1 with EOS ignored, so every
request produces its output length (vLLM's settings). Per request: time to first token (from its
admission) and time per output token after the first; overall: requests/s, output and total
tokens/s. A first untimed pass over the same workload compiles kernels and captures device graphs
(lazily captured graph sizes would otherwise land in the timing).

`sweep` runs a grid (concurrency x input length x output length); `plots.py` draws its throughput
against per-token latency, and a `bench e2e` file's step times against the HBM floor.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from deepinfer.errors import UserError


@dataclass
class Request:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class ThroughputResult:
    concurrency: int
    num_requests: int
    input_len: float  # mean prompt tokens
    output_len: float  # mean output tokens
    seconds: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft_ms: dict  # mean / median / p99 time to first token
    tpot_ms: dict  # mean / median / p99 time per output token after the first


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int = 0) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)

    def lengths(mean: int) -> list[int]:
        low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return torch.randint(low, high + 1, (num_prompts,), generator=gen).tolist()

    ins, outs = lengths(input_len), lengths(output_len)
    return [Request(torch.randint(0, vocab_size, (n,), generator=gen).tolist(), m) for n, m in zip(ins, outs)]


def jsonl_requests(path: Path, tokenizer, output_len: int) -> list[Request]:
    """One request per line: {"prompt": str} or {"prompt_token_ids": [...]}, optionally "max_tokens"
    (default output_len)."""
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{number}: not JSON ({exc.msg}); each line must be an object with \"prompt\" or \"prompt_token_ids\"") from None
        if not isinstance(row, dict) or ("prompt" not in row) == ("prompt_token_ids" not in row):
            raise UserError(f"{path}:{number}: each line needs exactly one of \"prompt\" or \"prompt_token_ids\"")
        if "prompt" in row:
            if tokenizer is None:
                raise UserError(f"{path}:{number}: this model has no tokenizer; give prompt_token_ids")
            ids = tokenizer.encode(row["prompt"])
        else:
            ids = row["prompt_token_ids"]
        max_tokens = row.get("max_tokens", output_len)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise UserError(f"{path}:{number}: max_tokens must be an integer >= 1, not {max_tokens!r}")
        requests.append(Request(list(ids), max_tokens))
    if not requests:
        raise UserError(f"{path} holds no requests")
    return requests


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def _drive(engine, requests: list[Request], concurrency: int, synchronize) -> tuple[float, list[tuple[float, float, int]]]:
    """Run the workload; (seconds, per request (ttft, seconds after the first token, output tokens))."""
    pending = deque(requests)
    inflight: dict[int, list] = {}  # seq_id -> [seq, admitted, first token time]
    timings = []
    synchronize()
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(inflight) < concurrency:
            request = pending.popleft()
            seq = engine.add_request(request.prompt_token_ids, _params(request))
            inflight[seq.seq_id] = [seq, time.perf_counter(), None]
        finished = engine.step()  # returns with the step's tokens on the host
        now = time.perf_counter()
        for entry in inflight.values():
            if entry[2] is None and entry[0].num_output_tokens > 0:
                entry[2] = now
        for seq in finished:
            _, admitted, first = inflight.pop(seq.seq_id)
            timings.append((first - admitted, now - first, seq.num_output_tokens))
    synchronize()
    return time.perf_counter() - start, timings


def run(llm, requests: list[Request], concurrency: int, warmup: bool = True) -> ThroughputResult:
    """The workload on llm's engine with at most `concurrency` requests in flight."""
    from deepinfer.bench.device_api import synchronize

    engine = llm.engine
    for r in requests:
        engine.check_request(r.prompt_token_ids, _params(r), "a request")
    sync = lambda: synchronize(engine.runtime.device)  # noqa: E731
    if warmup:  # compiles and captures what the workload needs; then the cache it filled is forgotten,
        _drive(engine, requests, concurrency, sync)  # so that the timed pass computes the same steps, not prefix hits
        engine.reset_prefix_cache()
    seconds, timings = _drive(engine, requests, concurrency, sync)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(n for _, _, n in timings)
    return ThroughputResult(
        concurrency=concurrency,
        num_requests=len(requests),
        input_len=prompt_tokens / len(requests),
        output_len=output_tokens / len(requests),
        seconds=seconds,
        requests_per_s=len(requests) / seconds,
        output_tokens_per_s=output_tokens / seconds,
        total_tokens_per_s=(prompt_tokens + output_tokens) / seconds,
        ttft_ms=_percentiles([t * 1e3 for t, _, _ in timings]),
        tpot_ms=_percentiles([rest * 1e3 / (n - 1) for _, rest, n in timings if n > 1]),
    )


def random_shape_llm(backend: str, layers: int | None, engine_options: dict, overrides: dict | None = None, tokenizer=None):
    """An LLM over bench e2e's random-weight DeepSeek-V2-Lite-shaped model (bf16, cut to `layers`),
    for serving figures at a real model's sizes without its checkpoint; engine_options: EngineConfig's.
    overrides: config values changed (bench structured: DeepSeek-V3's vocabulary); tokenizer: the
    model's (none by default: token-id prompts only)."""
    import dataclasses

    from deepinfer.bench.e2e import ENGINE_KV_CACHE_GIB, V2_LITE, build_v2_lite
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
    from deepinfer.runtime import open_runtime

    cfg = dict(V2_LITE, **({"num_hidden_layers": layers} if layers else {}), **(overrides or {}))
    runtime = open_runtime(backend, dtype=torch.bfloat16)
    loaded, hf = build_v2_lite(runtime, cfg)
    del hf  # the transformers peer bench e2e compares with: not needed here
    if tokenizer is not None:
        loaded = dataclasses.replace(loaded, tokenizer=tokenizer)
    config = EngineConfig(kv_cache_memory_gib=ENGINE_KV_CACHE_GIB, **engine_options)
    return LLM.from_engine(LLMEngine(loaded, runtime, torch.bfloat16, config))


def shape_llm(shape: str, backend: str, layers: int | None, engine_options: dict, command: str, dtype: str = "auto"):
    """An LLM over a `--model-shape` model: "v2-lite" (`random_shape_llm`, bf16) or "v4-flash" (deepinfer/bench/v4_flash_llm.py:
    cut to fit, FP8 KV, engine_options' max_model_len the workload's; `dtype` its activations', "auto": LLM's rule)."""
    if shape == "v4-flash":
        from deepinfer.bench.v4_flash_llm import random_flash_llm

        return random_flash_llm(backend, layers, engine_options, command=f"{command} --model-shape v4-flash", dtype=dtype)
    return random_shape_llm(backend, layers, engine_options)


def longest_request(input_lens, output_lens, range_ratio: float) -> int:
    """The most tokens (prompt and output) a request of the random workloads can have: each length drawn at most
    int(len x (1 + range_ratio)) (`random_requests`, bench serve's `random_workload`)."""
    return max(max(1, int(n * (1 + range_ratio))) for n in input_lens) + max(max(1, int(n * (1 + range_ratio))) for n in output_lens)


def _params(request: Request):
    from deepinfer.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=1.0, max_tokens=request.output_len, ignore_eos=True)


def sweep(llm, workloads: list[tuple[int, int, int]], make_requests) -> list[ThroughputResult]:
    """Every (concurrency, input_len, output_len) of the grid; make_requests(input_len, output_len)
    gives the workload (the same one for every concurrency of a length pair)."""
    results, made = [], {}
    for concurrency, input_len, output_len in workloads:
        key = (input_len, output_len)
        if key not in made:
            made[key] = make_requests(input_len, output_len)
        results.append(run(llm, made[key], concurrency))
    return results


def write_json(path: Path, results: list[ThroughputResult], machine: dict) -> None:
    path.write_text(json.dumps({"kind": "throughput", "machine": machine, "results": [asdict(r) for r in results]}, indent=1))


def format_results(results: list[ThroughputResult]) -> str:
    def ms(d: dict, key: str) -> str:
        return "-" if d[key] is None else f"{d[key]:.1f}"

    lines = ["concurrency  requests  in len  out len  req/s  out tok/s  total tok/s  TTFT mean/p99 ms  TPOT mean/p99 ms"]
    for r in results:
        lines.append(
            f"{r.concurrency:11d}  {r.num_requests:8d}  {r.input_len:6.0f}  {r.output_len:7.0f}  {r.requests_per_s:5.2f}  {r.output_tokens_per_s:9.1f}"
            f"  {r.total_tokens_per_s:11.1f}  {ms(r.ttft_ms, 'mean'):>7} / {ms(r.ttft_ms, 'p99'):<7}  {ms(r.tpot_ms, 'mean'):>7} / {ms(r.tpot_ms, 'p99')}"
        )
    return "\n".join(lines)
