#!/usr/bin/env bash
# Deterministic mode on the cuda backend, in two calls on nvidia-h200 (repo root; each fits one 10-minute run):
#   deterministic_check.sh identity   conformance of the batch-invariant kernels, the bit-identity checks and the
#                                     cross-backend logits (tools/gpu/deterministic_check.py, LAYERS layers, default 4)
#   deterministic_check.sh bench      decode throughput of deterministic mode against the default at batch 1, 64
#                                     and 256 (bench e2e, V2-Lite-shaped random model, no HF peer), and the
#                                     engine-level determinism tests on the GPU
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
case "${1:-identity}" in
identity)
  step conformance 200 python -m deepinfer conformance --backend cuda --deterministic --quiet --json "$R/conformance.json"
  step identity 360 python tools/gpu/deterministic_check.py --layers "${LAYERS:-4}" --json "$R/identity.json"
  tail -2 "$R/conformance.txt"; tail -12 "$R/identity.txt" ;;
bench)
  step e2e_default 200 python -m deepinfer bench e2e --backend cuda --no-hf --batch 1 --batch 64 --batch 256 --json "$R/e2e_default.json"
  step e2e_deterministic 250 python -m deepinfer bench e2e --backend cuda --no-hf --batch 1 --batch 64 --batch 256 --deterministic --json "$R/e2e_deterministic.json"
  step e2e_tests 100 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider tests/engine/test_deterministic_kernels.py -k cuda
  tail -6 "$R/e2e_default.txt"; tail -6 "$R/e2e_deterministic.txt"; tail -3 "$R/e2e_tests.txt" ;;
esac
