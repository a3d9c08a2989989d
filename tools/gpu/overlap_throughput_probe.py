"""Why a serving workload runs slower with overlap scheduling (GPU): the `bench throughput` workload on the
random V2-Lite-shaped model, with overlap on and off, each engine step timed and classified (prefill, decode,
decode launched ahead; replayed graph or eager; graph captures), then a per-kind summary.

python tools/gpu/overlap_throughput_probe.py [--layers 8] [--prompts 256]
"""

import argparse
import collections
import gc
import time
import warnings

import torch

from deepinfer.bench import throughput

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=8)
p.add_argument("--prompts", type=int, default=256)
p.add_argument("--modes", default="on,off,on", help="overlap per pass, in order (on: overlap, off: --no-overlap)")
p.add_argument("--lengths", default="mixed", choices=["mixed", "fixed"], help="prompt/output lengths +-50%% or fixed")
args = p.parse_args()
spread = 0.5 if args.lengths == "mixed" else 0.0

for mode in args.modes.split(","):
    overlap = None if mode == "on" else False
    llm = throughput.random_shape_llm("cuda", args.layers, {"max_num_seqs": 64, "overlap": overlap})
    engine, runner = llm.engine, llm.engine.runner
    requests = throughput.random_requests(args.prompts, 512, 128, spread, engine.vocab_size, 0)
    throughput.run(llm, requests, 64, warmup=False)  # compile, capture
    kinds, seconds, sizes = collections.Counter(), collections.Counter(), collections.Counter()
    launch = runner.launch

    current = []  # what the engine step in progress did

    def traced_launch(batch, *a, **kw):
        kind = "prefill" if batch.is_prefill else ("graph" if runner.replayable(batch) else "eager")
        kinds["launch_" + kind] += 1
        sizes[kind] += len(batch.seqs)
        current.append(kind)
        t = time.perf_counter()
        out = launch(batch, *a, **kw)
        seconds["launch_" + kind] += time.perf_counter() - t
        return out

    if engine.overlap is not None:
        finish = engine.overlap._finish

        def traced_finish(step):
            current.append("finish")
            kinds["finish"] += 1
            t = time.perf_counter()
            out = finish(step)
            seconds["finish"] += time.perf_counter() - t
            return out

        engine.overlap._finish = traced_finish

    runner.launch = traced_launch
    if runner.graphs is not None:
        capture = runner.graphs._capture
        runner.graphs._capture = lambda size: kinds.update(["capture"]) or capture(size)
    step = engine.step

    def traced_step():
        current.clear()
        t = time.perf_counter()
        out = step()
        took = time.perf_counter() - t
        seconds["step"] += took
        kinds["step"] += 1
        seconds["step:" + "+".join(current)] += took
        kinds["step:" + "+".join(current)] += 1
        return out

    engine.step = traced_step
    syncs = collections.Counter()  # host-device synchronisations inside the engine, by the deepinfer line that caused them
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = throughput.run(llm, requests, 64, warmup=False)
    torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        syncs[f"{w.filename}:{w.lineno} {str(w.message)[:60]}"] += 1
    print(f"overlap={overlap}: {result.seconds:.2f} s, out tok/s {result.output_tokens_per_s:.0f}, TTFT {result.ttft_ms['mean']:.1f} ms, "
          f"TPOT {result.tpot_ms['mean']:.2f} ms; steps {kinds['step']} in {seconds['step']:.2f} s; {dict(kinds)}; "
          f"mean rows {({k: round(v / max(kinds['launch_' + k], 1), 1) for k, v in sizes.items()})}", flush=True)
    for where, n in syncs.most_common(12):
        print(f"  sync x{n}: {where}", flush=True)
    for key in sorted(seconds):
        count = kinds.get(key, kinds.get(key.removeprefix("launch_"), 0)) or kinds.get("launch_" + key, 0) or 1
        print(f"  {key:28s} {seconds[key] * 1e3:9.1f} ms in all, {count:5d} calls, {seconds[key] * 1e3 / count:7.2f} ms each", flush=True)
    llm = engine = runner = None  # the next pass builds its own model
    gc.collect()
    torch.cuda.empty_cache()
