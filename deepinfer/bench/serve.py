"""`deepinfer bench serve`: an OpenAI-compatible server driven over HTTP at a sweep of request rates
(vLLM's `bench serve` shape), from an async client (httpx2).

After an untimed warm-up pass, for each rate: --num-prompts requests of random token-id prompts,
new ones per rate so that no rate hits the prefix cache another filled (lengths drawn uniformly in
len x [1 - r, 1 + r]), arrive as a Poisson process of that rate (inf: all at once), each a streamed
/v1/completions request with ignore_eos and max_tokens its output length. Per request: TTFT (the
first streamed token), TPOT ((latency - TTFT) / (output tokens - 1)), ITL (the gaps between
streamed chunks: one engine step each). Per rate: request and token throughputs over the wall
time, and mean / median / p90 / p99 of each latency, in ms.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


def random_workload(num: int, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request; the same for the same arguments."""
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    return [([rng.randrange(1, vocab) for _ in range(length(input_len))], length(output_len)) for _ in range(num)]


async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int, headers: dict) -> RequestRecord:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    record = RequestRecord(False, len(prompt))
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    record.error = event["error"]["message"]
                    return record
                now = time.perf_counter()
                if event.get("choices"):
                    if last is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                if event.get("usage"):
                    record.output_len = event["usage"]["completion_tokens"]
    except Exception as exc:  # the connection failed: this request's record, the run goes on
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.latency_s = time.perf_counter() - start
    record.ok = record.ttft_s is not None
    return record


async def run_rate(url: str, model: str, workload, rate: float, seed: int, headers: dict, max_connections: int) -> tuple[list[RequestRecord], float]:
    import httpx2

    rng = random.Random(seed)
    limits = httpx2.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(None), limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in workload:
            tasks.append(asyncio.create_task(one_request(client, url, model, prompt, max_tokens, headers)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - start


def percentiles(values: list[float]) -> dict:
    """mean, median, p90, p99 in ms (None when there are no values)."""
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] * 1e3

    return {"mean": sum(ordered) / len(ordered) * 1e3, "median": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def summarize(rate: float, records: list[RequestRecord], wall_s: float) -> dict:
    ok = [r for r in records if r.ok]
    output = sum(r.output_len for r in ok)
    prompt = sum(r.prompt_len for r in ok)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "completed": len(ok), "failed": len(records) - len(ok), "errors": sorted({r.error for r in records if not r.ok})[:5],
        "duration_s": wall_s, "request_throughput": len(ok) / wall_s, "output_tokens_per_s": output / wall_s,
        "total_tokens_per_s": (output + prompt) / wall_s,
        "ttft_ms": percentiles([r.ttft_s for r in ok]), "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([gap for r in ok for gap in r.itl_s]), "e2e_ms": percentiles([r.latency_s for r in ok]),
    }  # fmt: skip


def sweep(url: str, model: str, make_workload, rates: list[float], seed: int, api_key: str | None = None, max_connections: int = 1024,
          warmup: bool = True, server_steps=None) -> list[dict]:  # fmt: skip
    """Each rate over a workload of its own (make_workload(seed + i)): prompts a rate before it sent
    would hit the server's prefix cache and make a different, cheaper workload. warmup: first an
    untimed pass, all at once, over prompts of their own (the server compiles and captures there).
    server_steps: a function giving the server's (engine steps, their seconds) so far, or None where
    it cannot tell; each rate then records the steps it took and their mean time."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if warmup:
        asyncio.run(run_rate(url, model, make_workload(seed + len(rates)), math.inf, seed, headers, max_connections))
    results = []
    for i, rate in enumerate(rates):
        before = server_steps() if server_steps else None
        records, wall = asyncio.run(run_rate(url, model, make_workload(seed + i), rate, seed, headers, max_connections))
        result = summarize(rate, records, wall)
        after = server_steps() if server_steps else None
        if before is not None and after is not None:
            steps, seconds = after[0] - before[0], after[1] - before[1]
            result["server_steps"] = int(steps)
            result["server_step_ms"] = seconds / steps * 1e3 if steps else None
        results.append(result)
    return results


def server_step_totals(url: str, api_key: str | None = None) -> tuple[float, float] | None:
    """(engine steps, their seconds) so far, from a deepinfer server's /metrics (`deepinfer_step_seconds`);
    None when the server has no such metric (another server) or cannot be asked."""
    import httpx2

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        reply = httpx2.get(f"{url}/metrics", headers=headers, timeout=30)
    except httpx2.HTTPError:
        return None
    if reply.status_code != 200:
        return None
    values = {}
    for line in reply.text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in ("deepinfer_step_seconds_count", "deepinfer_step_seconds_sum"):
            values[name] = float(value)
    if len(values) < 2:
        return None
    return values["deepinfer_step_seconds_count"], values["deepinfer_step_seconds_sum"]


def format_results(results: list[dict]) -> str:
    def ms(d: dict, key: str) -> str:
        return "-" if d[key] is None else f"{d[key]:.1f}"

    heads = ("TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99")
    steps = any("server_steps" in r for r in results)
    lines = [f"{'rate':>6} {'done':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} " + " ".join(f"{h:>9}" for h in heads) + f" {'ITL p99':>8}"
             + (f" {'steps':>6} {'step ms':>8}" if steps else "")]  # fmt: skip
    for r in results:
        line = (f"{str(r['request_rate']):>6} {r['completed']:>5} {r['failed']:>4} {r['request_throughput']:>7.2f} {r['output_tokens_per_s']:>9.1f} "
                f"{ms(r['ttft_ms'], 'median'):>9} {ms(r['ttft_ms'], 'p99'):>9} {ms(r['tpot_ms'], 'median'):>9} {ms(r['tpot_ms'], 'p99'):>9} "
                f"{ms(r['itl_ms'], 'p99'):>8}")  # fmt: skip
        if steps:
            step_ms = r.get("server_step_ms")
            line += f" {r.get('server_steps', '-'):>6} {'-' if step_ms is None else f'{step_ms:.2f}':>8}"
        lines.append(line)
    return "\n".join(lines)


def to_json(results: list[dict], machine: dict, workload: dict) -> dict:
    return {"kind": "serve", "machine": machine, "workload": workload, "results": results}

