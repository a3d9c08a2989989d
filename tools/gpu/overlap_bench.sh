#!/usr/bin/env bash
# One call on nvidia-h200 (repo root): overlap scheduling on the V2-Lite-shaped random model cut to LAYERS layers
# (default 8): bench e2e with and without overlap at batch 1, 64 and 256; device idle time within the decode steps
# (tools/gpu/e2e_profile.py traces, both ways); deterministic mode's cost with both modes interleaved
# (tools/gpu/deterministic_cost.py; overlap on in both).
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
L=${LAYERS:-8}
mkdir -p "$R/traces"
step e2e_overlap 100 python -m deepinfer bench e2e --backend cuda --no-hf --layers "$L" --batch 1 --batch 64 --batch 256 --json "$R/e2e_overlap.json"
step e2e_sync 100 python -m deepinfer bench e2e --backend cuda --no-hf --layers "$L" --batch 1 --batch 64 --batch 256 --no-overlap --json "$R/e2e_sync.json"
step idle_overlap 90 python tools/gpu/e2e_profile.py --layers "$L" --batch 1 --batch 64 --rows 8 --trace "$R/traces"
step idle_sync 90 python tools/gpu/e2e_profile.py --layers "$L" --batch 1 --batch 64 --rows 8 --trace "$R/traces" --no-overlap
rm -f "$R"/traces/*.json  # large; the idle figures are in the step outputs
step det_cost 150 python tools/gpu/deterministic_cost.py --layers "$L" --reps 5 --json "$R/det_cost.json"
tail -4 "$R/e2e_overlap.txt"; tail -4 "$R/e2e_sync.txt"; grep "^###" "$R/idle_overlap.txt" "$R/idle_sync.txt"; grep "^batch" "$R/det_cost.txt"
