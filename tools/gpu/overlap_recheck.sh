#!/usr/bin/env bash
# On nvidia-h200 (repo root): `bench throughput` with overlap scheduling and mixed steps each on and off, after the
# warm-up pass's prefix cache is forgotten before the timed pass (before, the timed pass hit the cache, prefilled
# other shapes and compiled their kernels inside the timing), and `bench sweep` over concurrencies with overlap on
# and off. V2-Lite-shaped random model cut to LAYERS (default 8); 256 requests, prompts 512 +-50%, outputs 128 +-50%.
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
L=${LAYERS:-8}
W=(--backend cuda --model-shape v2-lite --layers "$L" --num-prompts 256 --input-len 512 --output-len 128 --range-ratio 0.5 --concurrency 64)
step tp_default 150 python -m deepinfer bench throughput "${W[@]}" --json "$R/tp_default.json"
step tp_no_mixed 120 python -m deepinfer bench throughput "${W[@]}" --no-mixed-steps --json "$R/tp_no_mixed.json"
step tp_no_overlap 120 python -m deepinfer bench throughput "${W[@]}" --no-overlap --json "$R/tp_no_overlap.json"
step tp_neither 120 python -m deepinfer bench throughput "${W[@]}" --no-overlap --no-mixed-steps --json "$R/tp_neither.json"
S=(--backend cuda --model-shape v2-lite --layers "$L" --num-prompts 128 --input-len 512 --output-len 128
   --concurrency 1 --concurrency 8 --concurrency 32 --concurrency 128)
step sweep 200 python -m deepinfer bench sweep "${S[@]}" --json "$R/sweep.json" --plot "$R"
step sweep_no_overlap 200 python -m deepinfer bench sweep "${S[@]}" --no-overlap --json "$R/sweep_no_overlap.json"
for f in tp_default tp_no_mixed tp_no_overlap tp_neither sweep sweep_no_overlap; do echo "## $f"; grep -E "^ +[0-9]|concurrency|rror" "$R/$f.txt" | head -8; done
