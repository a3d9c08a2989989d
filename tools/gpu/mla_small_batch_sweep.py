"""mla_decode at small batches and long contexts (H200): how many splits fill the GPU.

For B in 1, 4, 8 x ctx 8k, 32k, 64k x 16 and 128 heads (bf16 cache, pages of 64 in shuffled
order, S = 1): the default plan, the fused merge instead of the wide combine, and split-count
variants (max_splits, min_tokens_per_split); at B 32, 64, 128 x ctx 4096 the default, the fused
merge and the wide combine from 2 splits (where its threshold sits). Each
timed eagerly (do_bench: what `bench ops` reports, host launch cost included where it dominates)
and as a CUDA-graph replay (the engine's decode), and checked against a float32 torch computation.
Prints one line per variant: us, TB/s of the cache read, TFLOP/s, splits.
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from deepinfer_cuda.bench.attention_decode import PAGE, SCALE, _mla_bytes, _mla_flops, _mla_setup, _torch_reference
from deepinfer_cuda.kernels import mla_decode as mla


def graph_us(fn) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return do_bench(graph.replay, warmup=10, rep=60, return_mode="median") * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--ctxs", default="8192,32768,65536")
    p.add_argument("--heads", default="16,128")
    args = p.parse_args()
    device = torch.device("cuda")
    small = [{}, {"wide_combine": False}, {"max_splits": 128}, {"max_splits": 256}, {"max_splits": 128, "min_tokens_per_split": 128},
             {"max_splits": 256, "min_tokens_per_split": 128}]  # fmt: skip
    mid = [{}, {"wide_combine": False}, {"wide_min_splits": 2}]
    shapes = [(h, b, c, small) for h in (int(x) for x in args.heads.split(",")) for b in (int(x) for x in args.batches.split(","))
              for c in (int(x) for x in args.ctxs.split(","))]
    shapes += [(h, b, 4096, mid) for h in (16, 128) for b in (32, 64, 128)]  # where the wide combine's threshold sits
    for heads, batch, ctx, variants in shapes:
        s = _mla_setup(batch, ctx, heads)(device)
        ref = _torch_reference(s)
        call = (s["q_nope"], s["q_rope"], s["kv_cache"], s["block_table"], s["seq_lens"], SCALE, None)
        for overrides in variants:
            try:
                out = mla.launch_mla_decode(*call, overrides=overrides)
                err = float(((out.float() - ref).norm() / ref.norm()).item())
                eager = do_bench(lambda: mla.launch_mla_decode(*call, overrides=overrides), warmup=10, rep=60, return_mode="median") * 1e3
                replay = graph_us(lambda: mla.launch_mla_decode(*call, overrides=overrides))
            except Exception as exc:
                print(f"B{batch} ctx{ctx} H{heads} {overrides}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
                continue
            splits = mla.plan(batch, heads, s["block_table"].shape[1] * PAGE, device, None, None, overrides)[4]
            tbs, tf = _mla_bytes(s) / replay / 1e6, _mla_flops(s) / replay / 1e6
            print(f"B{batch:<2d} ctx{ctx:<6d} H{heads:<4d} {str(overrides):52s} splits {splits:4d}  eager {eager:7.1f} us  graph {replay:7.1f} us"
                  f"  {tbs:5.2f} TB/s {tf:6.1f} TFLOP/s  err {err:.1e}", flush=True)  # fmt: skip
        del s, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
