#!/usr/bin/env bash
# On nvidia-h200 (repo root): tools/gpu/sample_dispatch_probe.py (sample's first-pass variants, dispatch's
# bounds); `bash tools/gpu/sample_dispatch_probe.sh recheck` then runs sample_recheck.sh (the kernels
# compiled against the reference, their profile and bench rows) and the dispatch/combine bench rows.
source tools/gpu/preamble.sh
step probe 330 python tools/gpu/sample_dispatch_probe.py
cut -c1-220 "$R/probe.txt"
if [ "$1" = recheck ]; then
  source tools/gpu/sample_recheck.sh
  step moe_ops 120 python -m deepinfer bench ops --backend cuda --op dispatch --op combine --json "$R/moe_ops.json"
  tail -6 "$R/moe_ops.txt" | cut -c1-160
fi
