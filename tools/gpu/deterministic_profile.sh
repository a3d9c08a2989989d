#!/usr/bin/env bash
# One call on nvidia-h200 (repo root): where deterministic mode's decode cost goes: unprofiled ms per decode step,
# the host's Python functions (cProfile) and the kernels per decode step of each mode at batch 1 and 64
# (tools/gpu/e2e_profile.py; V2-Lite-shaped random model cut to LAYERS layers, default 8), Chrome traces under r/traces.
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
L=${LAYERS:-8}
mkdir -p "$R/traces"
step profile_default 240 python tools/gpu/e2e_profile.py --layers "$L" --batch 1 --batch 64 --trace "$R/traces" --host
step profile_deterministic 240 python tools/gpu/e2e_profile.py --layers "$L" --batch 1 --batch 64 --deterministic --trace "$R/traces" --host
for f in default deterministic; do grep -A16 "^### batch 64" "$R/profile_$f.txt" | grep -v "^$"; done
