#!/usr/bin/env bash
# One call on nvidia-h200 (repo root): speculative decoding's verification policies, fixed-5 against
# confidence-5, at 16 and 64 concurrent requests on the V2-Lite-shaped random model (LAYERS layers,
# default all 27), drafts from a controlled source agreeing at 0.9 x 0.8^i (deepinfer/bench/speculative.py);
# DETERMINISTIC=1: every run in deterministic mode (bf16 continuations then survive speculation's batch shapes).
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
step spec 480 python -m deepinfer bench speculative --backend cuda ${LAYERS:+--layers $LAYERS} ${DETERMINISTIC:+--deterministic} \
  --concurrency 16 --concurrency 64 --json "$R/spec.json"
tail -8 "$R/spec.txt"
