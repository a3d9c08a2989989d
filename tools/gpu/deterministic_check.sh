#!/usr/bin/env bash
# Deterministic mode on the cuda backend, in two calls on nvidia-h200 (repo root; each fits one 10-minute run):
#   deterministic_check.sh identity     the bit-identity checks and the cross-backend logits
#                                       (tools/gpu/deterministic_check.py, LAYERS layers, default 4), then the decode
#                                       throughput of deterministic mode against the default at batch 1, 64 and 256
#                                       (bench e2e, V2-Lite-shaped random model cut to BENCH_LAYERS layers, default 8),
#                                       and the golden set of the invariant GEMM kernels
#   deterministic_check.sh conformance  the golden set on the batch-invariant kernels (compiles every kernel: minutes)
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
case "${1:-identity}" in
identity)
  step identity 300 python tools/gpu/deterministic_check.py --layers "${LAYERS:-4}" --json "$R/identity.json"
  step e2e_default 120 python -m deepinfer bench e2e --backend cuda --no-hf --layers "${BENCH_LAYERS:-8}" --batch 1 --batch 64 --batch 256 --json "$R/e2e_default.json"
  step e2e_deterministic 150 python -m deepinfer bench e2e --backend cuda --no-hf --layers "${BENCH_LAYERS:-8}" --batch 1 --batch 64 --batch 256 --deterministic --json "$R/e2e_deterministic.json"
  step conformance_gemm 200 python -m deepinfer conformance --backend cuda --deterministic --op linear --op grouped_gemm --quiet --json "$R/conformance_gemm.json"
  tail -12 "$R/identity.txt"; tail -6 "$R/e2e_default.txt"; tail -6 "$R/e2e_deterministic.txt"; tail -3 "$R/conformance_gemm.txt" ;;
conformance)
  step conformance 560 python -m deepinfer conformance --backend cuda --deterministic --json "$R/conformance.json"
  tail -5 "$R/conformance.txt" ;;
esac
