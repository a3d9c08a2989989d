#!/usr/bin/env bash
# One call on nvidia-h200 (repo root): DeepSeek-V4's figures. The GEMM golden cases again (the SM90 MX
# tuning entries changed after the sweep), `deepinfer bench ops` for the V4 ops, the FP8-cache attention
# cases and the grouped GEMM, then `deepinfer bench e2e --model-shape v4-flash` (batch 1/64/256, context
# 4k/32k, fp8 linears + mxfp4 experts + fp8 KV, layers cut to fit).
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
step conformance_gemm 100 python -m deepinfer conformance --backend cuda --op linear --op grouped_gemm --json "$R/conformance_gemm.json"
step bench_ops 230 python -m deepinfer bench ops --backend cuda --json "$R/bench_ops_v4.json" \
  --op sparse_attention --op compress_kv --op indexer_topk --op hc_pre --op hc_post --op clamped_silu_and_mul \
  --op mla_decode --op kv_cache_write --op grouped_gemm
step bench_e2e_v4 230 python -m deepinfer bench e2e --backend cuda --model-shape v4-flash --json "$R/bench_e2e_v4.json"
tail -1 "$R/conformance_gemm.txt"; grep -E " fail | error " "$R/conformance_gemm.txt" | head
grep -vE "^\s*$" "$R/bench_ops.txt" | tail -60
tail -25 "$R/bench_e2e_v4.txt"
