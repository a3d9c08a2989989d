#!/usr/bin/env bash
# One call on nvidia-h200 (repo root): the float32 router GEMM's tiles (tools/gpu/router_gemm_sweep.py), then
# bench e2e in both modes with the best candidate.
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
step sweep 560 python tools/gpu/router_gemm_sweep.py --json "$R/sweep.json" --e2e
grep -v Warning "$R/sweep.txt" | grep -v "^(" | tail -40
