"""The float32 router GEMM's tiles (GPU only): the MoE router is a float32 linear (HF's MoEGate) of
N = experts outputs over K = hidden, summed with FMAs, not the MMA. The dense bf16 tiles it used to
take spent 43-83 us per call on the H200 (the e2e profile, 2026-12-02: 10-17% of a decode step).
This times the `dense_f32` candidates (weights rotated past L2, calls captured in a CUDA graph) at
1, 64 and 256 rows, in the default plan (the candidate as dense_f32_small and _large) and the
batch-invariant one (as dense_f32_invariant), against torch.mm in float32 (cuBLAS, TF32 off),
checking each result against float64.

--e2e: then `bench e2e` (8 layers, batch 1/64/256) in both modes with the candidate of the smallest
worst time over every row count and mode.

python tools/gpu/router_gemm_sweep.py [--hidden 2048] [--experts 64] [--json FILE] [--e2e]
"""

import argparse
import itertools
import json

import torch
from decode_gemm_sweep import L2_BYTES, graph_us

from deepinfer_cuda.kernels import gemm as G
from deepinfer_cuda.tuning import config as base_config

ROWS = (1, 64, 256)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, min_iters_per_split)
CANDIDATES = [c for c in itertools.product((16, 32), (32, 64), (16, 32, 64), (2, 4), (1, 2))]


def with_f32_entry(candidate):
    bm, bn, bk, warps, min_iters = candidate

    def lookup(op, variant, device):
        if op == "gemm" and variant.startswith("dense_f32"):
            return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps, "num_stages": 3, "min_iters_per_split": min_iters}
        return base_config(op, variant, device)

    return lookup


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--e2e", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    copies = max(1, 2 * L2_BYTES // (args.experts * args.hidden * 4))
    ws = [torch.randn(args.experts, args.hidden, device=dev) * 0.02 for _ in range(copies)]
    xs = {m: torch.randn(m, args.hidden, device=dev) for m in ROWS}
    exact = {m: (xs[m].double() @ ws[0].double().T) for m in ROWS}

    def time(m, fn):
        return graph_us([lambda w=w: fn(xs[m], w) for w in ws], reps=2)

    torch_us = {m: time(m, lambda x, w: torch.mm(x, w.T)) for m in ROWS}
    G.config = base_config
    current = {(m, inv): time(m, lambda x, w, inv=inv: G.launch_gemm(x, w, None, "dense", G._LINEAR, invariant=inv)) for m in ROWS for inv in (False, True)}
    print("torch.mm fp32: " + "  ".join(f"m{m} {torch_us[m]:6.1f} us" for m in ROWS))
    print("shipped      : " + "  ".join(f"m{m} {current[m, False]:6.1f}/{current[m, True]:6.1f} us" for m in ROWS) + "   (default/invariant)", flush=True)
    rows = []
    for cand in CANDIDATES:
        G.config = with_f32_entry(cand)
        us = {}
        err = 0.0
        for m in ROWS:
            for inv in (False, True):
                us[m, inv] = time(m, lambda x, w, inv=inv: G.launch_gemm(x, w, None, "dense", G._LINEAR, invariant=inv))
                out = G.launch_gemm(xs[m], ws[0], None, "dense", G._LINEAR, invariant=inv)
                err = max(err, ((out.double() - exact[m]).abs().max() / exact[m].abs().max()).item())
        rows.append({"candidate": cand, "us": {f"{m}/{'inv' if inv else 'def'}": v for (m, inv), v in us.items()}, "rel_err": err,
                     "worst_inv": max(us[m, True] for m in ROWS), "worst_def": max(us[m, False] for m in ROWS)})  # fmt: skip
        print(f"{cand}: " + "  ".join(f"m{m} {us[m, False]:6.1f}/{us[m, True]:6.1f}" for m in ROWS) + f"  err {err:.1e}", flush=True)
    G.config = base_config
    for key in ("worst_def", "worst_inv"):
        best = sorted(rows, key=lambda r: r[key])[:5]
        print(f"best by {key}: " + "; ".join(f"{r['candidate']} {r[key]:.1f} us" for r in best))
    result = {"torch_us": torch_us, "shipped": {f"{m}/{inv}": v for (m, inv), v in current.items()}, "rows": rows}
    if args.e2e:
        from deepinfer.bench import e2e

        best = min(rows, key=lambda r: max(r["worst_def"], r["worst_inv"]))
        print(f"bench e2e with {best['candidate']}", flush=True)
        G.config = with_f32_entry(best["candidate"])
        del ws, xs
        torch.cuda.empty_cache()
        for det in (False, True):
            res = e2e.run(batches=ROWS, layers=8, with_hf=False, deterministic=det)
            print(f"e2e deterministic={det}:\n{e2e.format_results(res)}", flush=True)
            result[f"e2e deterministic={det}"] = {r.batch: r.deepinfer_step_ms for r in res}
        G.config = base_config
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
