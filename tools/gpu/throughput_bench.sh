#!/usr/bin/env bash
# Call 2 of 2 on nvidia-h200 (repo root; carry .whl): bench e2e and its profile again (after a GEMM change), cold start, `bench throughput` on the V2-Lite-shaped random model cut to LAYERS (default 8)
# with overlap scheduling and mixed steps each on and off (256 requests, prompts 512 +-50%, outputs 128 +-50%,
# 64 in flight: prefills arrive while others decode), `bench sweep` over concurrencies with its plot, and the
# FP8-cache readers' bench rows (mla_decode's 8-warp FP8 tiles, not re-measured before).
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
L=${LAYERS:-8}
step e2e 120 python -m deepinfer bench e2e --backend cuda --no-hf --layers "$L" --batch 1 --batch 64 --batch 256 --json "$R/e2e.json"
step profile 90 python tools/gpu/e2e_profile.py --layers "$L" --batch 1 --batch 256 --rows 6
bash tools/gpu/cold_start.sh
W=(--backend cuda --model-shape v2-lite --layers "$L" --num-prompts 256 --input-len 512 --output-len 128 --range-ratio 0.5 --concurrency 64)
step tp_default 120 python -m deepinfer bench throughput "${W[@]}" --json "$R/tp_default.json"
step tp_no_mixed 120 python -m deepinfer bench throughput "${W[@]}" --no-mixed-steps --json "$R/tp_no_mixed.json"
step tp_no_overlap 120 python -m deepinfer bench throughput "${W[@]}" --no-overlap --json "$R/tp_no_overlap.json"
step tp_neither 120 python -m deepinfer bench throughput "${W[@]}" --no-overlap --no-mixed-steps --json "$R/tp_neither.json"
step sweep 200 python -m deepinfer bench sweep --backend cuda --model-shape v2-lite --layers "$L" --num-prompts 128 --input-len 512 \
  --output-len 128 --concurrency 1 --concurrency 8 --concurrency 32 --concurrency 128 --json "$R/sweep.json" --plot "$R"
step bench_fp8 100 python -m deepinfer bench ops --backend cuda --json "$R/bench_fp8.json" --op mla_decode --op sparse_attention
tail -4 "$R/e2e.txt"; grep -E "^###|_gemm|split_k" "$R/profile.txt" | cut -c1-120
for f in tp_default tp_no_mixed tp_no_overlap tp_neither sweep; do echo "## $f"; tail -n +1 "$R/$f.txt" | grep -E "^ +[0-9]|concurrency|Error|error" | head -8; done
grep -E "^(mla_decode|sparse_attention) " "$R/bench_fp8.txt" | cut -c1-150
