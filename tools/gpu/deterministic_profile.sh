#!/usr/bin/env bash
# One call on nvidia-h200 (repo root): where deterministic mode's decode cost goes: the kernels per decode step
# of each mode at batch 1 and 64 (tools/gpu/e2e_profile.py; V2-Lite-shaped random model cut to LAYERS layers,
# default 8), with Chrome traces under r/traces. The cost itself: `deterministic_check.sh identity` (bench e2e in both modes).
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
L=${LAYERS:-8}
mkdir -p "$R/traces"
step profile_default 240 python tools/gpu/e2e_profile.py --layers "$L" --batch 1 --batch 64 --trace "$R/traces"
step profile_deterministic 240 python tools/gpu/e2e_profile.py --layers "$L" --batch 1 --batch 64 --deterministic --trace "$R/traces"
grep -A14 "^### batch 64" "$R/profile_default.txt"; grep -A14 "^### batch 64" "$R/profile_deterministic.txt"
