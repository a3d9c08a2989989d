"""Deterministic mode's throughput cost, both modes in one process, interleaved (GPU only).

python tools/gpu/deterministic_cost.py [--layers 8] [--reps 7] [--new-tokens 64] [--batch B ...] [--json FILE]

`bench e2e` run once per mode put deterministic mode's batch-64 cost anywhere between +4% and +19% on
the H200 (2026-12-02) while its kernels per decode step differed by +5% (tools/gpu/e2e_profile.py): a
decode step there is host-bound (0.4-1.6 ms of device idle per step, the same host code in both modes),
and that idle time wanders between runs. Here the two engines (the same random V2-Lite-shaped
weights, cut to --layers) alternate, run after run, each batch's step time (bench e2e's: generating
1 + N tokens minus generating 1, over N) is the median over --reps alternations, and the cost is the
ratio of the medians.
"""

import argparse
import gc
import json
import statistics
import time

import torch

from deepinfer.bench import e2e
from deepinfer.bench.device_api import synchronize
from deepinfer.runtime import open_runtime

BATCHES = (1, 64, 256)
PROMPT = 128


def timed(llm, prompts, n, device) -> float:
    gc.collect()
    synchronize(device)
    start = time.perf_counter()
    e2e.greedy(llm, prompts, n)
    synchronize(device)
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    batches = tuple(args.batch or BATCHES)
    cfg = dict(e2e.V2_LITE, num_hidden_layers=args.layers)
    engines = {}
    for det in (False, True):
        runtime = open_runtime("auto", dtype=torch.bfloat16, deterministic=det)
        loaded, _ = e2e.build_v2_lite(runtime, cfg)
        engines[det] = (e2e.bench_llm(loaded, runtime, max(batches), PROMPT, det), runtime.device)
    gen = torch.Generator().manual_seed(1)
    result = {}
    for batch in batches:
        prompts = e2e.random_prompts(cfg, batch, PROMPT, gen)
        for llm, _ in engines.values():
            e2e.greedy(llm, prompts, 1), e2e.greedy(llm, prompts, 1 + args.new_tokens)  # compile, capture
        steps = {False: [], True: []}
        for _ in range(args.reps):
            for det, (llm, device) in engines.items():
                t1 = timed(llm, prompts, 1, device)
                tn = timed(llm, prompts, 1 + args.new_tokens, device)
                steps[det].append((tn - t1) / args.new_tokens * 1e3)
        med = {det: statistics.median(v) for det, v in steps.items()}
        result[batch] = {"default_ms": med[False], "deterministic_ms": med[True], "cost": med[True] / med[False] - 1, "runs": steps}
        spread = {det: (min(v), max(v)) for det, v in steps.items()}
        print(f"batch {batch:4d}: default {med[False]:.2f} ms/step ({spread[False][0]:.2f}-{spread[False][1]:.2f}), "
              f"deterministic {med[True]:.2f} ({spread[True][0]:.2f}-{spread[True][1]:.2f}): cost {med[True] / med[False] - 1:+.1%}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            info = {"layers": args.layers, "reps": args.reps, "new_tokens": args.new_tokens, "date": time.strftime("%Y-%m-%d")}
            json.dump({**info, "results": result}, f, indent=1)


if __name__ == "__main__":
    main()
