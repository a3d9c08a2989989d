#!/usr/bin/env bash
# On nvidia-h200 (repo root; carry .whl with .whl/serve): `deepinfer bench serve` on the V2-Lite-shaped random model
# cut to LAYERS (default 8) after the server's start-up warm-up (every prefill size, every decode graph).
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
L=${LAYERS:-8}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/serve/*.whl >/dev/null 2>&1 || echo "serve wheels failed"
step bench_serve 420 python -m deepinfer bench serve --backend cuda --model-shape v2-lite --layers "$L" --num-prompts 128 --input-len 512 \
  --output-len 128 --range-ratio 0.5 --request-rate 8 --request-rate 32 --request-rate inf --json "$R/bench_serve.json" --plot "$R"
tail -8 "$R/bench_serve.txt"
