"""Batch-1 decode GEMMs of the V2-Lite-shaped e2e model: split-K policy sweep (GPU only).

The "dense_small" tuning entry was measured on wide shapes (64 experts x 16 tokens, 16 x 7168 ->
36864), where the tiles alone fill the GPU. At batch 1 with hidden 2048 the same tiles give a few
dozen programs and split-K stops at 2 (BLOCK_K 256: 8 K steps, min_iters_per_split 4), far from
what HBM needs. This times each shape (weights rotated through copies larger than L2, calls
captured in a CUDA graph as the engine's decode steps are) for split policies, tiles unchanged:
min_iters_per_split x split_target_per_sm. Prints a table and the best policy by total time.

python tools/gpu/decode_gemm_sweep.py [--json FILE]
"""

import argparse
import json

import torch

from deepinfer_cuda.kernels import gemm as G
from deepinfer_cuda.tuning import config as base_config

L2_BYTES = 60 << 20
# (name, layout, m rows, k, n, experts): the linears of one V2-Lite decode step at batch 1.
SHAPES = [
    ("q_proj 2048->3072", "linear", 1, 2048, 3072, 1),
    ("kv_a 2048->576", "linear", 1, 2048, 576, 1),
    ("o_proj 2048->2048", "linear", 1, 2048, 2048, 1),
    ("shared up 2048->5632", "linear", 1, 2048, 5632, 1),
    ("shared down 2816->2048", "linear", 1, 2816, 2048, 1),
    ("experts up 6 rows / 64, 2048->2816", "grouped", 6, 2048, 2816, 64),
    ("experts down 6 rows / 64, 1408->2048", "grouped", 6, 1408, 2048, 64),
    ("lm_head 2048->102400", "linear", 1, 2048, 102400, 1),
]
POLICIES = [(4, 2), (2, 2), (1, 2), (2, 4), (1, 4), (1, 8)]  # (min_iters_per_split, split_target_per_sm)


def with_policy(min_iters: int, target_per_sm: int):
    """The tuning lookup with dense_small's split policy replaced (tiles unchanged)."""

    def lookup(op, variant, device):
        cfg = dict(base_config(op, variant, device))
        if op == "gemm" and variant == "dense_small":
            cfg.update(min_iters_per_split=min_iters, split_target_per_sm=target_per_sm)
        return cfg

    return lookup


def make(shape, dev):
    name, layout, m, k, n, e = shape
    wbytes = e * n * k * 2  # every expert's weights (the copies below must exceed L2)
    copies = max(1, -(-2 * L2_BYTES // wbytes))
    ws = [torch.randn(*((e, n, k) if layout == "grouped" else (n, k)), device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    if layout == "grouped":
        ids = torch.randperm(e, device=dev)[:m].sort().values
        counts = torch.zeros(e, dtype=torch.int32, device=dev).index_add_(0, ids, torch.ones(m, dtype=torch.int32, device=dev))
        offs = torch.zeros(e + 1, dtype=torch.int32, device=dev)
        offs[1:] = counts.cumsum(0)
        calls = [lambda w=w: G.grouped_gemm(x, w, expert_offsets=offs, fmt="dense") for w in ws]
    else:
        calls = [lambda w=w: G.linear(x, w, fmt="dense") for w in ws]
    touched = (min(m, e) if layout == "grouped" else 1) * n * k * 2  # the weights one call reads
    return calls, touched


def graph_us(calls, reps=20):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for c in calls:
                c()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps * len(calls))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--e2e", action="store_true", help="then `bench e2e` (no HF peer) with the current and the best policy")
    args = ap.parse_args()
    dev = torch.device("cuda")
    built = [(s, *make(s, dev)) for s in SHAPES]
    copy = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(copy)
    for _ in range(3):
        dst.copy_(copy)
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(10):
        dst.copy_(copy)
    t1.record()
    torch.cuda.synchronize()
    copy_tbs = 2 * (1 << 30) * 10 / (t0.elapsed_time(t1) * 1e-3) / 1e12  # bytes read + written per second
    del copy, dst
    rows = []
    for mi, tg in POLICIES:
        G.config = with_policy(mi, tg)
        line = []
        for shape, calls, wbytes in built:
            us = graph_us(calls)
            line.append(us)
            rows.append({"min_iters_per_split": mi, "split_target_per_sm": tg, "shape": shape[0], "us": us, "weight_tbs": wbytes / us / 1e6})
        print(f"min_iters {mi} target/SM {tg}: " + "  ".join(f"{u:7.1f}" for u in line) + f"  total {sum(line):8.1f} us", flush=True)
    G.config = base_config
    print("shapes: " + " | ".join(s[0] for s in SHAPES))
    totals = {}
    for r in rows:
        totals[(r["min_iters_per_split"], r["split_target_per_sm"])] = totals.get((r["min_iters_per_split"], r["split_target_per_sm"]), 0.0) + r["us"]
    best = min(totals, key=totals.get)
    floor = sum(w for _, _, w in built) / (copy_tbs * 1e12) * 1e6
    print(f"copy {copy_tbs:.2f} TB/s (read + written); weights one pass reads / copy rate: {floor:.1f} us; "
          f"best policy {best}: {totals[best]:.1f} us (current (4, 2): {totals[(4, 2)]:.1f} us)")
    result = {"rows": rows, "best": best, "totals": {str(k): v for k, v in totals.items()}, "copy_tbs": copy_tbs}
    if args.e2e:
        from deepinfer.bench import e2e

        del built
        torch.cuda.empty_cache()
        for label, (mi, tg) in (("current", (4, 2)), ("best", best)):
            G.config = with_policy(mi, tg)
            res = e2e.run(batches=(1, 64), with_hf=False)
            print(f"e2e with the {label} policy {(mi, tg)}:\n{e2e.format_results(res)}", flush=True)
            result[f"e2e_{label}"] = [vars(r) if not hasattr(r, "__dataclass_fields__") else {k: getattr(r, k) for k in r.__dataclass_fields__} for r in res]
        G.config = base_config
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
