#!/usr/bin/env bash
# One call on nvidia-h200 (repo root): the FP8 KV cache after its rows became 16-byte aligned
# (W + 16 bytes): golden cases of the four ops that touch the cache, their bench rows (bf16 and
# fp8 side by side), then a torch-profiler view of a V4-Flash-shaped decode step (tools/gpu/v4_profile.py).
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
step conformance_kv 200 python -m deepinfer conformance --backend cuda --json "$R/conformance_kv.json" \
  --op kv_cache_write --op mla_decode --op sparse_attention --op indexer_topk
step bench_kv 150 python -m deepinfer bench ops --backend cuda --json "$R/bench_kv.json" \
  --op mla_decode --op kv_cache_write --op sparse_attention --op indexer_topk
step profile 170 python tools/gpu/v4_profile.py --layers 4
tail -1 "$R/conformance_kv.txt"; grep -E " fail | error " "$R/conformance_kv.txt" | head
grep -E "^(mla_decode|kv_cache_write|sparse_attention|indexer_topk) " "$R/bench_kv.txt" | cut -c1-150
grep -E "ms per step|^\s+[A-Za-z_].{60,}" "$R/profile.txt" | cut -c1-170 | head -90
