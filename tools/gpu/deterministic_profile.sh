#!/usr/bin/env bash
# One call on nvidia-h200 (repo root): deterministic mode's decode cost against the default, and where it goes:
# bench e2e at batch 1, 64 and 256 in both modes (V2-Lite-shaped random model cut to LAYERS layers, default 8),
# then the kernels of each mode at batch 1 and 64 (tools/gpu/e2e_profile.py).
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
L=${LAYERS:-8}
step e2e_default 120 python -m deepinfer bench e2e --backend cuda --no-hf --layers "$L" --batch 1 --batch 64 --batch 256 --json "$R/e2e_default.json"
step e2e_deterministic 150 python -m deepinfer bench e2e --backend cuda --no-hf --layers "$L" --batch 1 --batch 64 --batch 256 --deterministic --json "$R/e2e_deterministic.json"
step profile_default 200 python tools/gpu/e2e_profile.py --layers "$L" --batch 1 --batch 64
step profile_deterministic 200 python tools/gpu/e2e_profile.py --layers "$L" --batch 1 --batch 64 --deterministic
tail -6 "$R/e2e_default.txt"; tail -6 "$R/e2e_deterministic.txt"
grep -A14 "^### batch 64" "$R/profile_default.txt"; grep -A14 "^### batch 64" "$R/profile_deterministic.txt"
