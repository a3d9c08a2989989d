#!/usr/bin/env bash
# One call on nvidia-h200 (repo root): deterministic mode's GEMM tile sweep and bench e2e with the best entry
# (tools/gpu/invariant_gemm_sweep.py; LAYERS layers, default 8).
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
step sweep 570 python tools/gpu/invariant_gemm_sweep.py --layers "${LAYERS:-8}" --json "$R/sweep.json"
cat "$R/sweep.txt" | grep -v Warning | tail -30
