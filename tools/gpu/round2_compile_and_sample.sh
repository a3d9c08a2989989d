#!/usr/bin/env bash
# On nvidia-h200 (repo root): `deepinfer bench compile` (every cuda kernel built for SM90 and SM100:
# registers, spills, matrix instruction class) and the sample kernels' device-time profile.
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
step sample_profile 150 python tools/gpu/sample_profile.py
grep -v Warning "$R/sample_profile.txt" | tail -40
step compile 420 python -m deepinfer bench compile --json "$R/compile.json"
tail -25 "$R/compile.txt"
