"""`bench prefix-reuse`: the KV tiers behind the device prefix cache on DeepSeek's production workload shape, long
multi-turn conversations whose prompts grow by appending to the previous turn, with a working set several times
the device's KV pool (deepinfer/bench/prefix_reuse_workload.py makes it).

The same workload runs on fresh engines over the same loaded weights, one configuration after the other:

- "device": the device prefix cache alone, a pool of `num_kv_blocks` (the baseline the others are compared with);
- "+host": the same pool and a host tier (kv_offload_cpu_gib, by default enough for the whole working set);
- "+host+disk": and a disk tier (kv_offload_dir, a new temporary folder unless one is given, which must be empty);
- "restart": a second process (the same python, `prefix_reuse_restart`) builds the same model and an engine with
  only the disk tier, on the folder "+host+disk" filled, and replays the workload: its hits come from disk, the
  first turns' too (the JSON hand-off: a spec file in, a result file out);
- "unbounded": a pool that holds every conversation's context and two blocks per request in flight, so that nothing
  cached is ever evicted: the upper bound of the hit rate (the workload's `reusable_rate`).

Requests are driven through LLMEngine (add_request and step) in the workload's round-robin order, at most
`max_concurrency` in flight (default: every conversation, a whole turn's wave), a turn only once its conversation's
previous turn has finished (its prompt holds that turn's output). TTFT is from a request's submission (add_request)
to the end of the step that gave its first token: time spent waiting in the engine, for pool space or for a tier's
load, counts; time held back by the in-flight limit does not. Greedy decoding, `output_len` tokens, EOS ignored.

Per configuration: the hit rate (RequestOutput.num_cached_tokens over all prompt tokens) and its split by where the
tokens came from: each tier's share is the blocks the engine loaded from it (`kv_tier_stats()` hit_blocks) times the
block size, the device's what is left (a block loaded but not used, because another request computed it first or
the pool evicted it before its request was admitted, would count for its tier and be missing from the device's
share: the split is exact when nothing is loaded in vain). Prefill tokens computed (the engine's count: the work a
hit saves) and its ratio to the device-only run; TTFT p50 / p99; output tokens/s and wall time of the whole workload;
and how many requests' greedy tokens equal the device-only run's: all of them in deterministic mode (the default;
a hit's KV, loaded or kept, is bit for bit what was computed, and the kernels do not depend on how a prompt was
split), else near-ties may differ.

On a backend that compiles kernels or captures device graphs, each process warms up once (deepinfer.engine.warmup,
on an engine of its own without tiers) and each configuration's engine captures its graphs before it is timed.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deepinfer.bench.prefix_reuse_model import ModelSpec
from deepinfer.bench.prefix_reuse_workload import Workload, blocks_for
from deepinfer.errors import UserError

CONFIGS = ("device", "host", "disk", "restart", "unbounded")
LABELS = {"device": "device", "host": "+host", "disk": "+host+disk", "restart": "restart", "unbounded": "unbounded"}
TIERS = ("host", "disk", "store")
GiB = 1 << 30
HOST_MARGIN = 1.25  # the default host tier: the working set's bytes times this
DISK_MARGIN = 2.0  # the default disk tier: the working set's bytes times this (each block's header and checksum besides)
SUBMISSION = "round-robin, at most {n} in flight, a turn once its conversation's previous turn finished"


@dataclass
class Settings:
    """How the configurations run (besides the workload and the model)."""

    num_kv_blocks: int  # the device pool of every configuration but "unbounded"
    unbounded_blocks: int
    max_concurrency: int
    max_num_batched_tokens: int
    kv_offload_cpu_gib: float
    kv_offload_disk_gib: float
    kv_offload_dir: str | None  # None: a temporary folder, removed at the end
    warmup: bool | None = None  # None: where the backend compiles kernels or captures graphs


@dataclass
class Row:
    config: str
    label: str
    num_kv_blocks: int
    tiers: list[str]
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    tokens_by_tier: dict  # "device", "host", "disk", "store" -> prompt tokens taken from there
    rate_by_tier: dict
    prefill_tokens_computed: int
    prefill_vs_device: float | None  # prefill tokens computed over the device-only run's (None: it did not run)
    ttft_ms: dict  # p50, p99, mean, max
    ttft_hit_ms: dict  # p50, p99 and count of the later turns' requests with cached tokens (a hit from some tier or the device)
    ttft_miss_ms: dict  # and of those without
    output_tokens: int
    output_tokens_per_s: float
    wall_s: float
    outputs_equal: int | None  # requests whose greedy tokens equal the device-only run's (None: it did not run)
    preemptions: int
    tier_stats: dict | None  # llm.kv_tier_stats() at the end
    steps: int = 0  # engine steps run
    tier_timing: dict | None = None  # KVTiers.timing: the engine thread's time in the tiers, its stalls on copies, idle waits
    per_request: list[dict] = field(default_factory=list)  # turn, conversation, prompt_tokens, cached_tokens, ttft_ms

    @property
    def outputs_differ(self) -> int:
        return 0 if self.outputs_equal is None else self.requests - self.outputs_equal


# ---------------------------------------------------------------------------------------------
# One configuration's run: shared by this process and the restart process


def sampling_params(workload: Workload):
    from deepinfer.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)


def drive(engine, workload: Workload, max_concurrency: int) -> dict:
    """Run the workload on `engine` (module docstring: order, in-flight limit, TTFT); what it measured, JSON-able:
    per request (turn, conversation, prompt and cached tokens, ttft_ms, output token ids), wall_s, the engine's
    counters and the tiers' stats. The tiers are closed at the end, a failed run's too: every offload copied and
    every store write done (a restart finds them all; nothing writes into the disk folder once it is removed)."""
    computed0, generated0, steps0 = engine.num_prompt_tokens_computed, engine.num_generated_tokens, engine.num_steps
    try:
        records, wall = _requests(engine, workload, max_concurrency)
    finally:
        if engine.tiers is not None:
            engine.tiers.close()
    return {
        "records": records,
        "wall_s": wall,
        "prefill_tokens_computed": engine.num_prompt_tokens_computed - computed0,
        "generated_tokens": engine.num_generated_tokens - generated0,
        "tier_stats": engine.tiers.stats() if engine.tiers is not None else None,
        "tier_timing": engine.tiers.timing.report() if engine.tiers is not None else None,
        "steps": engine.num_steps - steps0,
        "num_kv_blocks": engine.num_kv_blocks,
        "block_size": engine.block_size,
    }


def _requests(engine, workload: Workload, max_concurrency: int) -> tuple[list[dict], float]:
    """Submit the workload's requests in order, step the engine until all have finished: (records by turn and
    conversation, wall seconds)."""
    from collections import deque

    from deepinfer.bench.device_api import synchronize

    conversations = workload.conversations_state()
    params = sampling_params(workload)
    pending = deque(workload.order())
    inflight: dict[int, dict] = {}  # seq_id -> its record (and the Sequence, dropped when it finishes)
    records = []
    device = engine.runtime.device
    synchronize(device)
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(inflight) < max_concurrency:
            turn, conv = pending[0]
            if turn > 0 and not conversations.finished(turn - 1, conv):
                break  # in order: the next request waits for its conversation's previous turn
            pending.popleft()
            prompt = conversations.prompt(turn, conv)
            seq = engine.add_request(prompt, params, what=f"conversation {conv} turn {turn + 1}")
            inflight[seq.seq_id] = {"seq": seq, "turn": turn, "conversation": conv, "prompt_tokens": len(prompt), "submitted": time.perf_counter(),
                                    "first": None}  # fmt: skip
        finished = engine.step()
        now = time.perf_counter()
        for record in inflight.values():
            if record["first"] is None and record["seq"].num_output_tokens > 0:
                record["first"] = now
        for seq in finished:
            record = inflight.pop(seq.seq_id)
            output = engine.make_output(seq)
            tokens = list(output.outputs[0].token_ids)
            conversations.record(record["turn"], record["conversation"], tokens)
            records.append({"turn": record["turn"], "conversation": record["conversation"], "prompt_tokens": record["prompt_tokens"],
                            "cached_tokens": output.num_cached_tokens, "ttft_ms": (record["first"] - record["submitted"]) * 1e3,
                            "preemptions": output.metrics.get("num_preemptions", 0), "output": tokens})  # fmt: skip
    synchronize(device)
    wall = time.perf_counter() - start
    records.sort(key=lambda r: (r["turn"], r["conversation"]))
    return records, wall


def warm_up_process(loaded, runtime, dtype, config) -> None:
    """Compile what the run's steps compile on first use (prefills of each power of two, decode graphs), once per
    process, on an engine of its own without tiers (deepinfer.engine.warmup)."""
    from deepinfer.bench.device_api import empty_cache
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.engine.warmup import warm_up

    plain = dataclasses.replace(config, kv_offload_cpu_gib=None, kv_offload_dir=None, kv_offload_disk_gib=None, kv_offload_ttl_s=None, kv_store_url=None)
    engine = LLMEngine(loaded, runtime, dtype, plain)
    warm_up(engine)
    del engine
    gc.collect()
    empty_cache(runtime.device)


def wants_warmup(runtime, warmup: bool | None) -> bool:
    return warmup if warmup is not None else bool(runtime.compiles_on_first_use or runtime.graph_capture is not None)


def engine_config(spec: ModelSpec, workload: Workload, settings: Settings, num_kv_blocks: int, **tiers):
    from deepinfer.engine.llm_engine import EngineConfig

    return EngineConfig(max_num_seqs=settings.max_concurrency, max_num_batched_tokens=settings.max_num_batched_tokens, num_kv_blocks=num_kv_blocks,
                        max_model_len=workload.longest, deterministic=spec.deterministic, kv_cache_dtype=spec.cache_dtype(), **tiers)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The figures of one run


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by the nearest rank above (p99 of 100 values: the 99th)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ttfts(records: list[dict]) -> dict:
    values = [r["ttft_ms"] for r in records]
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99), "requests": len(values)}


def make_row(config: str, measured: dict, baseline: dict | None, tiers: list[str]) -> Row:
    """The figures of one configuration's run (`drive`'s result), against the device-only run's (None: not run)."""
    records = measured["records"]
    block_size = measured["block_size"]
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    stats = measured["tier_stats"] or {}
    by_tier = {name: stats.get(name, {}).get("hit_blocks", 0) * block_size for name in TIERS}
    by_tier = {"device": cached - sum(by_tier.values()), **by_tier}
    ttfts = [r["ttft_ms"] for r in records]
    outputs = sum(len(r["output"]) for r in records)
    equal = None
    if baseline is not None:
        theirs = {(r["turn"], r["conversation"]): r["output"] for r in baseline["records"]}
        equal = sum(r["output"] == theirs.get((r["turn"], r["conversation"])) for r in records)
    prefill = measured["prefill_tokens_computed"]
    return Row(
        config=config, label=LABELS[config], num_kv_blocks=measured["num_kv_blocks"], tiers=tiers, requests=len(records), prompt_tokens=prompt,
        cached_tokens=cached, hit_rate=cached / prompt, tokens_by_tier=by_tier, rate_by_tier={k: v / prompt for k, v in by_tier.items()},
        prefill_tokens_computed=prefill,
        prefill_vs_device=prefill / baseline["prefill_tokens_computed"] if baseline and baseline["prefill_tokens_computed"] else None,
        ttft_ms={"p50": percentile(ttfts, 0.5), "p99": percentile(ttfts, 0.99), "mean": statistics.fmean(ttfts), "max": max(ttfts)},
        ttft_hit_ms=_ttfts([r for r in records if r["turn"] > 0 and r["cached_tokens"] > 0]),
        ttft_miss_ms=_ttfts([r for r in records if r["turn"] > 0 and r["cached_tokens"] == 0]),
        output_tokens=outputs, output_tokens_per_s=outputs / measured["wall_s"], wall_s=measured["wall_s"], outputs_equal=equal,
        preemptions=sum(r["preemptions"] for r in records), tier_stats=measured["tier_stats"], steps=measured["steps"],
        tier_timing=measured["tier_timing"],
        per_request=[{k: r[k] for k in ("turn", "conversation", "prompt_tokens", "cached_tokens", "ttft_ms")} for r in records],
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The whole benchmark


def default_pool(workload: Workload, block_size: int, multiple: float) -> int:
    """A device pool the working set is `multiple` times of (at least one longest request's blocks)."""
    return max(blocks_for(workload.longest, block_size), math.ceil(workload.working_set_blocks(block_size) / multiple))


def unbounded_pool(workload: Workload, block_size: int, max_concurrency: int) -> int:
    """Every conversation's context and two blocks per request in flight (its partial last block, the one it is
    filling): nothing cached is ever evicted."""
    return workload.working_set_blocks(block_size) + 2 * max_concurrency


def run(spec: ModelSpec, workload_args: dict, configs: tuple[str, ...] = CONFIGS, *, num_kv_blocks: int | None = None, kv_cache_gib: float | None = None,
        working_set_multiple: float = 4.0, max_concurrency: int | None = None, max_num_batched_tokens: int = 8192,
        kv_offload_cpu_gib: float | None = None, kv_offload_dir: str | None = None, kv_offload_disk_gib: float | None = None,
        warmup: bool | None = None, json_path: Path | None = None, progress=None) -> dict:  # fmt: skip
    """Measure `configs` (of CONFIGS, run in that order) on the workload of `workload_args` (Workload's fields but
    vocab_size, the model's). The device pool: num_kv_blocks, or kv_cache_gib's worth, or the working set over
    working_set_multiple. Returns the report (what --json writes): machine, settings, workload, results (rows)."""
    from deepinfer.bench import prefix_reuse_model
    from deepinfer.bench.device_api import empty_cache
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.engine.model_runner import kv_block_bytes
    from deepinfer.engine.warmup import capture_graphs
    from deepinfer.ops import kv_cache_format

    say = progress or (lambda line: print(f"deepinfer: {line}", file=sys.stderr, flush=True))
    configs = tuple(c for c in CONFIGS if c in configs)
    workload = Workload(vocab_size=prefix_reuse_model.vocab_size(spec), **workload_args)
    concurrency = max_concurrency or workload.conversations

    def plan(block_size: int) -> tuple[int, int, int]:  # v4-flash's layer count leaves room for the largest pool
        largest = unbounded_pool(workload, block_size, concurrency) if "unbounded" in configs else (num_kv_blocks or default_pool(workload, block_size, 1.0))
        return largest, concurrency, max_num_batched_tokens

    built = prefix_reuse_model.build(spec, workload.longest, plan)
    spec = dataclasses.replace(spec, layers=built.layers)  # the restart process builds this many
    runtime, loaded, dtype = built.runtime, built.loaded, built.dtype
    block_size = int(runtime.backend.kv_block_size)
    block_bytes = kv_block_bytes(loaded.model, block_size, kv_cache_format.cache_dtype(spec.cache_dtype(), dtype))
    pool = num_kv_blocks or (max(1, int(kv_cache_gib * GiB) // block_bytes) if kv_cache_gib else default_pool(workload, block_size, working_set_multiple))
    longest_blocks = blocks_for(workload.longest, block_size)
    if pool < longest_blocks:
        raise UserError(f"a device pool of {pool} blocks of {block_size} tokens cannot hold the longest request ({workload.longest} tokens, {longest_blocks} "
                        "blocks): raise --num-kv-blocks / --kv-cache-gib or lower --working-set-multiple")  # fmt: skip
    ws_blocks = workload.working_set_blocks(block_size)
    ws_bytes = ws_blocks * block_bytes
    settings = Settings(
        num_kv_blocks=pool, unbounded_blocks=unbounded_pool(workload, block_size, concurrency), max_concurrency=concurrency,
        max_num_batched_tokens=max_num_batched_tokens, kv_offload_cpu_gib=kv_offload_cpu_gib or _gib(ws_bytes * HOST_MARGIN),
        kv_offload_disk_gib=kv_offload_disk_gib or _gib(ws_bytes * DISK_MARGIN), kv_offload_dir=kv_offload_dir, warmup=wants_warmup(runtime, warmup),
    )  # fmt: skip
    say(f"{built.described}; {workload.conversations} conversations x {workload.turns} turns, working set {ws_blocks} blocks of {block_size} tokens "
        f"= {ws_blocks / pool:.2f}x the device pool of {pool}")  # fmt: skip
    folder = Path(kv_offload_dir) if kv_offload_dir else Path(tempfile.mkdtemp(prefix="deepinfer-prefix-reuse-"))
    measured: dict[str, dict] = {}
    rows: list[Row] = []
    try:
        if settings.warmup:
            say("warming up (compiles, graphs)")
            warm_up_process(loaded, runtime, dtype, engine_config(spec, workload, settings, pool))
        for config in configs:
            say(f"measuring {LABELS[config]}")
            if config == "restart":
                if "disk" not in measured:
                    raise UserError("the restart configuration replays the disk tier the +host+disk run filled: add disk to --configs")
                result, digest = run_restart(spec, workload, settings, folder)
                if digest != prefix_reuse_model.weights_digest(loaded.model):
                    raise UserError("the restart process built other weights than this one (their digests differ): its disk hits would be another "
                                    "model's KV; the random weights must be reproducible on this backend")  # fmt: skip
                measured[config] = result
            else:
                tiers = _tier_options(config, settings, folder)
                blocks = settings.unbounded_blocks if config == "unbounded" else pool
                engine = LLMEngine(loaded, runtime, dtype, engine_config(spec, workload, settings, blocks, **tiers))
                if settings.warmup:
                    capture_graphs(engine)
                measured[config] = drive(engine, workload, concurrency)
                del engine
                gc.collect()
                empty_cache(runtime.device)
            rows.append(make_row(config, measured[config], measured.get("device"), _tier_names(config)))
            say(f"{LABELS[config]}: hit rate {rows[-1].hit_rate:.1%}, prefill tokens {rows[-1].prefill_tokens_computed}, {rows[-1].wall_s:.1f} s")
    finally:
        if not kv_offload_dir:
            shutil.rmtree(folder, ignore_errors=True)
    machine = {**machine_info_of(runtime), "model": built.described, "layers": built.layers, "dtype": str(dtype).removeprefix("torch."),
               "kv_cache_dtype": spec.cache_dtype(), "deterministic": spec.deterministic}  # fmt: skip
    report = {
        "kind": "prefix-reuse",
        "machine": machine,
        "settings": {**asdict(settings), "model_shape": spec.shape, "kv_offload_dir": kv_offload_dir, "block_size": block_size, "block_bytes": block_bytes,
                     "working_set_multiple": ws_blocks / pool, "submission": SUBMISSION.format(n=concurrency), "configs": list(configs)},  # fmt: skip
        "workload": workload.describe(block_size),
        "results": [{**asdict(r), "outputs_differ": r.outputs_differ} for r in rows],
    }
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=1) + "\n")
    return report


def machine_info_of(runtime) -> dict:
    """prefix_replay.machine_info's fields from the runtime alone."""
    import torch

    from deepinfer.bench.device_api import device_name, host_cpu_name, on_host

    device = runtime.device
    info = {"device": device_name(device), "torch": torch.__version__, "backend": runtime.backend.name, "backend_options": dict(runtime.options),
            "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    if on_host(device):
        info["cpu"] = host_cpu_name()
        info["cpu_threads"] = torch.get_num_threads()
    return info


def _gib(nbytes: float) -> float:
    return max(nbytes, 1 << 20) / GiB


def _tier_names(config: str) -> list[str]:
    return {"host": ["host"], "disk": ["host", "disk"], "restart": ["disk"]}.get(config, [])


def _tier_options(config: str, settings: Settings, folder: Path) -> dict:
    """EngineConfig's tier options of a configuration run in this process."""
    options = {}
    if config in ("host", "disk"):
        options["kv_offload_cpu_gib"] = settings.kv_offload_cpu_gib
    if config == "disk":
        options.update(kv_offload_dir=str(folder), kv_offload_disk_gib=settings.kv_offload_disk_gib)
    return options


# ---------------------------------------------------------------------------------------------
# The restart process


def run_restart(spec: ModelSpec, workload: Workload, settings: Settings, folder: Path) -> tuple[dict, str]:
    """Run the workload in a second process on the disk tier in `folder` (deepinfer/bench/prefix_reuse_restart.py):
    (its `drive` result, the digest of the weights it built). One line when it fails."""
    import torch

    with tempfile.TemporaryDirectory(prefix="deepinfer-prefix-reuse-restart-") as hand_off:
        spec_path, out_path = Path(hand_off) / "spec.json", Path(hand_off) / "result.json"
        spec_path.write_text(json.dumps({"model": asdict(spec), "workload": asdict(workload), "settings": asdict(settings), "kv_offload_dir": str(folder),
                                         "cpu_threads": torch.get_num_threads()}))  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "deepinfer.bench.prefix_reuse_restart", str(spec_path), str(out_path)],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0 or not out_path.exists():
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            last = lines[-1].removeprefix("deepinfer: error: ") if lines else "no message"
            raise UserError(f"the restart process failed (exit {done.returncode}): {last}")
        result = json.loads(out_path.read_text())
    return result["measured"], result["weights_digest"]


# ---------------------------------------------------------------------------------------------
# Output


def format_report(report: dict) -> str:
    w, s = report["workload"], report["settings"]
    lines = [
        f"workload: {w['conversations']} conversations x {w['turns']} turns, turn 1 {w['prompt_len']} tokens, +{w['turn_tokens']} new a turn, "
        f"{w['output_len']} output tokens; {w['requests']} requests, {w['prompt_tokens']} prompt tokens; reuse {w['reuse_rate']:.1%} "
        f"(in full blocks {w['reusable_rate']:.1%}; after a run of the same workload {w['reusable_rate_after_a_run']:.1%})",
        f"device pool {s['num_kv_blocks']} blocks of {s['block_size']} tokens; working set {w['working_set_blocks']} blocks = "
        f"{s['working_set_multiple']:.2f}x the pool; unbounded pool {s['unbounded_blocks']}; host tier {s['kv_offload_cpu_gib']:.3g} GiB, "
        f"disk tier {s['kv_offload_disk_gib']:.3g} GiB",
        f"submission: {s['submission']}; TTFT from submission",
        "config      pool blocks  hit rate  device    host    disk   store  prefill tokens  vs device  TTFT p50 ms  TTFT p99 ms  out tok/s  "
        "wall s  step ms  tiers ms/step  stalls  equal",
    ]
    for r in report["results"]:
        rates = "  ".join(f"{r['rate_by_tier'][k]:6.1%}" for k in ("device", "host", "disk", "store"))
        ratio = "-" if r["prefill_vs_device"] is None else f"{r['prefill_vs_device']:.2f}x"
        equal = "-" if r["outputs_equal"] is None else f"{r['outputs_equal']}/{r['requests']}"
        steps, timing = max(1, r["steps"]), r["tier_timing"]
        tiers_ms = "-" if timing is None else f"{timing['engine_s'] * 1e3 / steps:.3f}"
        stalls = "-" if timing is None else str(timing["stalls"])
        lines.append(f"{r['label']:<10}  {r['num_kv_blocks']:11d}  {r['hit_rate']:8.1%}  {rates}  {r['prefill_tokens_computed']:14d}  {ratio:>9}  "
                     f"{r['ttft_ms']['p50']:11.1f}  {r['ttft_ms']['p99']:11.1f}  {r['output_tokens_per_s']:9.1f}  {r['wall_s']:6.1f}  "
                     f"{r['wall_s'] * 1e3 / steps:7.2f}  {tiers_ms:>13}  {stalls:>6}  {equal:>5}")  # fmt: skip
    lines.append("TTFT p50 / p99 ms of the requests with a prefix hit (first turns excluded) and of those without one:")
    for r in report["results"]:
        hit, miss = r["ttft_hit_ms"], r["ttft_miss_ms"]
        lines.append(f"  {r['label']:<10}  hits {_p50_p99(hit):>17} ({hit['requests']})   misses {_p50_p99(miss):>17} ({miss['requests']})")
    return "\n".join(lines)


def _p50_p99(t: dict) -> str:
    return "-" if not t["requests"] else f"{t['p50']:.1f} / {t['p99']:.1f}"


def notes(report: dict) -> list[str]:
    """Rows whose greedy tokens differ from the device-only run's: a bug in deterministic mode (a tier gave back other
    KV than was computed), else near-ties of the backend's own kernels."""
    differ = [r for r in report["results"] if r["outputs_differ"]]
    if not differ:
        return []
    rows = ", ".join(f"{r['label']} ({r['outputs_differ']} of {r['requests']})" for r in differ)
    if report["machine"]["deterministic"]:
        return [f"error: greedy tokens differ from the device-only run's in deterministic mode: {rows}; a hit's KV must be what was computed, "
                "so this is a bug (please report it)"]  # fmt: skip
    return [f"warning: greedy tokens differ from the device-only run's: {rows}. Without deterministic mode a prompt's logits depend on how "
            "it was split into steps and hits, and near-ties resolve differently; the default (deterministic mode) compares exactly."]  # fmt: skip
