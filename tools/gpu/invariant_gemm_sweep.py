"""Deterministic mode's GEMM tiles (GPU only): the batch-invariant plan takes one tuning entry for
every row count, so its tiles must serve batch 1 and batch 256 alike. This times the decode GEMMs
of the V2-Lite-shaped e2e model (weights rotated through copies larger than L2, calls captured in
a CUDA graph) at batch 1, 64 and 256 with the default plan and with the invariant plan under each
candidate entry, prints each candidate's cost over the default per batch, then runs `bench e2e`
in default mode and in deterministic mode with the candidate of the smallest worst-batch cost.

python tools/gpu/invariant_gemm_sweep.py [--layers N] [--json FILE]
"""

import argparse
import json

import torch
from decode_gemm_sweep import L2_BYTES, graph_us

from deepinfer_cuda.kernels import gemm as G
from deepinfer_cuda.tuning import config as base_config

H, INTER, MOE_INTER, EXPERTS, TOP_K, VOCAB = 2048, 10944, 1408, 64, 6, 102400
# (name, layout, k, n, per step): one decode step's GEMMs of the 8-layer e2e model (layer 0 dense).
SHAPES = [
    ("q_proj", "linear", H, 3072, 8),
    ("kv_a", "linear", H, 576, 8),
    ("o_proj", "linear", H, H, 8),
    ("dense up", "linear", H, 2 * INTER, 1),
    ("dense down", "linear", INTER, H, 1),
    ("shared up", "linear", H, 2 * 2 * MOE_INTER, 7),
    ("shared down", "linear", 2 * MOE_INTER, H, 7),
    ("experts up", "grouped", H, 2 * MOE_INTER, 7),
    ("experts down", "grouped", MOE_INTER, H, 7),
    ("lm_head", "linear", H, VOCAB, 1),
]
BATCHES = (1, 64, 256)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
CANDIDATES = [(64, 64, 256, 4, 4), (16, 64, 256, 4, 4), (32, 64, 256, 4, 4), (16, 64, 128, 4, 4), (32, 64, 128, 4, 4),
              (16, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 128, 8, 4), (32, 128, 128, 4, 4)]  # fmt: skip


def with_invariant_entry(candidate):
    """The tuning lookup with dense_small's tiles replaced (the entry the invariant plan reads)."""
    bm, bn, bk, warps, stages = candidate

    def lookup(op, variant, device):
        cfg = dict(base_config(op, variant, device))
        if op == "gemm" and variant == "dense_small":
            cfg.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        return cfg

    return lookup


def make(shape, batch, dev, invariant):
    name, layout, k, n, _ = shape
    experts = EXPERTS if layout == "grouped" else 1
    copies = max(1, -(-2 * L2_BYTES // (experts * n * k * 2)))
    ws = [torch.randn(*((experts, n, k) if layout == "grouped" else (n, k)), device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    if layout == "grouped":
        gen = torch.Generator().manual_seed(batch)
        chosen = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(batch)]).flatten()
        counts = torch.bincount(chosen, minlength=EXPERTS).to(torch.int32)
        offs = torch.zeros(EXPERTS + 1, dtype=torch.int32)
        offs[1:] = counts.cumsum(0)
        offs = offs.to(dev)
        x = torch.randn(batch * TOP_K, k, device=dev, dtype=torch.bfloat16)
        return [lambda w=w: G.launch_gemm(x, w, None, "dense", G._CONTIGUOUS, offsets=offs, invariant=invariant) for w in ws]
    x = torch.randn(batch, k, device=dev, dtype=torch.bfloat16)
    return [lambda w=w: G.launch_gemm(x, w, None, "dense", G._LINEAR, invariant=invariant) for w in ws]


def step_us(batch, dev, invariant):
    """One decode step's GEMM time (us), each shape times its count per step."""
    return sum(graph_us(make(s, batch, dev, invariant)) * s[4] for s in SHAPES)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    default = {b: step_us(b, dev, False) for b in BATCHES}
    print("default: " + "  ".join(f"b{b} {default[b]:8.1f} us" for b in BATCHES), flush=True)
    rows = []
    for cand in CANDIDATES:
        G.config = with_invariant_entry(cand)
        us = {b: step_us(b, dev, True) for b in BATCHES}
        worst = max(us[b] / default[b] for b in BATCHES)
        rows.append({"candidate": cand, "us": us, "worst": worst})
        print(f"{cand}: " + "  ".join(f"b{b} {us[b]:8.1f} us ({us[b] / default[b]:.2f}x)" for b in BATCHES) + f"  worst {worst:.2f}x", flush=True)
    G.config = base_config
    best = min(rows, key=lambda r: r["worst"])
    print(f"best {best['candidate']}: worst batch {best['worst']:.2f}x the default's GEMM time", flush=True)
    from deepinfer.bench import e2e

    torch.cuda.empty_cache()
    result = {"default_us": default, "rows": rows, "best": best}
    for label, det, cand in (("default", False, None), ("deterministic, best", True, best["candidate"])):
        G.config = with_invariant_entry(cand) if cand else base_config
        res = e2e.run(batches=BATCHES, layers=args.layers, with_hf=False, deterministic=det)
        print(f"e2e {label}:\n{e2e.format_results(res)}", flush=True)
        result[f"e2e {label}"] = {r.batch: r.deepinfer_step_ms for r in res}
    G.config = base_config
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
