"""Where a decode step of the e2e model spends its time (GPU only): kernels by time per decode step.

python tools/gpu/e2e_profile.py [--layers N] [--batch B ...] [--deterministic] [--rows R] [--trace DIR] [--host]

One engine per batch over `bench e2e`'s random V2-Lite-shaped model (warm-up compiles and captures
outside the profile). Two profiled generations that differ only in the tokens generated (1 and
1 + NEW): each kernel's time in the second minus its time in the first, over the NEW decode steps
between them, is its time per decode step (prefill cancels), so deterministic mode's kernels can be
set against the default's step by step. --trace writes the longer run's Chrome trace (device idle
time between steps shows there). Each batch first prints its unprofiled ms per decode step (fastest of 3);
--host then prints the host's Python functions by own time over the longer generation (cProfile).
"""

import argparse
import cProfile
import json
import pstats
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from deepinfer.bench import e2e
from deepinfer.bench.device_api import synchronize
from deepinfer.runtime import open_runtime

NEW = 16


def kernel_times(prof) -> Counter:
    """Self device time (us) by kernel name (device events only)."""
    times = Counter()
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0)
        if us and event.key and not event.key.startswith(("aten::", "cuda", "cu")):
            times[event.key] += us
    return times


def device_idle(trace: Path) -> tuple[float, float]:
    """(device idle ms, window ms) over the decode steps of a Chrome trace: from the first graph
    replay's first kernel to the last kernel, the time no kernel or copy ran (the profiler slows the
    host, so this is an upper bound)."""
    events = json.loads(trace.read_text())["traceEvents"]
    graphs = {e["args"].get("correlation") for e in events if e.get("name") == "cudaGraphLaunch"}
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    start = next((e["ts"] for e in device if e["args"].get("correlation") in graphs), None)
    if start is None:
        return float("nan"), float("nan")
    busy, end = 0.0, start
    for e in device:
        if e["ts"] + e["dur"] <= end:
            continue
        busy += e["ts"] + e["dur"] - max(e["ts"], end)
        end = e["ts"] + e["dur"]
    return (end - start - busy) / 1e3, (end - start) / 1e3


def step_split(trace: Path) -> tuple[float, float, float, int]:
    """Where a decode step's device time goes, from a Chrome trace, independent of the profiler's slower
    host: (mean ms a graph replay spans on the device, first kernel to last; of it, mean ms with no
    kernel running, the gaps between a graph's own kernels; mean ms of device work outside the replays
    per step, the input copies; number of replays). The unprofiled step minus the span and the outside
    work is the device's idle time between steps."""
    events = json.loads(trace.read_text())["traceEvents"]
    graphs = {e["args"].get("correlation") for e in events if e.get("name") == "cudaGraphLaunch"}
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    spans: dict = {}
    for e in device:
        c = e["args"].get("correlation")
        if c in graphs:
            a, b = spans.get(c, (e["ts"], e["ts"] + e["dur"]))
            spans[c] = (min(a, e["ts"]), max(b, e["ts"] + e["dur"]))
    if not spans:
        return float("nan"), float("nan"), float("nan"), 0
    ordered = sorted(spans.values())

    def busy(a: float, b: float) -> float:
        total, end = 0.0, a
        for e in device:
            s, t = max(e["ts"], end), min(e["ts"] + e["dur"], b)
            if t > s:
                total, end = total + t - s, t
        return total

    n = len(ordered)
    span = sum(b - a for a, b in ordered) / n
    inside_idle = sum(b - a - busy(a, b) for a, b in ordered) / n
    outside = sum(busy(b, a2) for (_, b), (a2, _) in zip(ordered, ordered[1:])) / max(n - 1, 1)
    return span / 1e3, inside_idle / 1e3, outside / 1e3, n


def profiled(llm, prompts, new_tokens: int, device, trace: Path | None = None) -> Counter:
    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        e2e.greedy(llm, prompts, new_tokens)
        synchronize(device)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    return kernel_times(prof)


parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, default=8)
parser.add_argument("--batch", type=int, action="append")
parser.add_argument("--prompt-len", type=int, default=128)
parser.add_argument("--deterministic", action="store_true")
parser.add_argument("--rows", type=int, default=25)
parser.add_argument("--trace", type=Path)
parser.add_argument("--host", action="store_true")
parser.add_argument("--no-overlap", action="store_true")
args = parser.parse_args()
batches = args.batch or [1]
cfg = dict(e2e.V2_LITE, num_hidden_layers=args.layers)
runtime = open_runtime("auto", dtype=torch.bfloat16, deterministic=args.deterministic)
loaded, _ = e2e.build_v2_lite(runtime, cfg)
llm = e2e.bench_llm(loaded, runtime, max(batches), args.prompt_len, args.deterministic, overlap=False if args.no_overlap else None)
gen = torch.Generator().manual_seed(1)
for batch in batches:
    prompts = e2e.random_prompts(cfg, batch, args.prompt_len, gen)
    e2e.greedy(llm, prompts, 1), e2e.greedy(llm, prompts, 1 + NEW)  # compile, capture
    wall = {}
    for n in (1, 1 + NEW):
        runs = []
        for _ in range(3):
            synchronize(runtime.device)
            start = time.perf_counter()
            e2e.greedy(llm, prompts, n)
            synchronize(runtime.device)
            runs.append(time.perf_counter() - start)
        wall[n] = min(runs)
    step_ms = (wall[1 + NEW] - wall[1]) / NEW * 1e3
    print(f"### batch {batch}: {step_ms:.3f} ms per decode step (unprofiled)")
    if args.host:
        host = cProfile.Profile()
        host.runcall(e2e.greedy, llm, prompts, 1 + NEW)
        pstats.Stats(host).sort_stats("tottime").print_stats(args.rows)
    short = profiled(llm, prompts, 1, runtime.device)
    name = f"trace_b{batch}_{'det' if args.deterministic else 'default'}{'_sync' if args.no_overlap else ''}.json"
    trace = args.trace / name if args.trace else None
    long = profiled(llm, prompts, 1 + NEW, runtime.device, trace)
    per_step = Counter({k: (long[k] - short.get(k, 0)) / NEW for k in long})
    total = sum(v for v in per_step.values() if v > 0)
    print(f"### batch {batch}, deterministic={args.deterministic}: {total / 1e3:.3f} ms of kernels per decode step")
    # the profiler slows the host but not the kernels: kernels over the unprofiled step bound the idle time from below
    print(f"### batch {batch}: device idle {max(0.0, 1 - total / 1e3 / step_ms):.1%} of the unprofiled step (1 - kernels / step)")
    if trace is not None:
        idle, window = device_idle(trace)
        print(f"### batch {batch}: device idle {idle:.2f} of {window:.2f} ms of decode steps ({idle / window:.1%}, profiled)")
        span, gaps, outside, n = step_split(trace)
        between = step_ms - span - outside
        print(f"### batch {batch}: a graph replay spans {span:.3f} ms on the device ({gaps:.3f} ms of it gaps between its kernels), "
              f"{outside:.3f} ms of device work between replays ({n} replays); idle between steps {between:.3f} ms = "
              f"{max(0.0, between) / step_ms:.1%} of the unprofiled step, idle inside the step {gaps / step_ms:.1%}")
    for name, us in per_step.most_common(args.rows):
        print(f"  {us:9.1f} us  {us / total:6.1%}  {name[:100]}")
