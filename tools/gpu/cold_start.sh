#!/usr/bin/env bash
# One call on nvidia-h200 (repo root, carry .whl): start-up cost of `deepinfer run` on the embedded tiny model.
# Cold: an empty Triton compile cache (TRITON_CACHE_DIR pointed at a fresh folder) and a fresh process; warm: the
# same command again with that cache (Triton keeps compiled kernels in ~/.triton/cache by default, so a user's
# second run is a warm one). Wall time of the whole process for 1 token (start to first token: imports, model
# load, compilation, device graph capture) and for 16 tokens.
[ -n "$R" ] || source tools/gpu/preamble.sh
unset TRITON_INTERPRET
timed() { local t=$EPOCHREALTIME; "$@" > /dev/null 2>&1 || echo "failed: $*" >&2; awk "BEGIN { printf \"%.1f\", $EPOCHREALTIME - $t }"; }
for tokens in 1 16; do
  export TRITON_CACHE_DIR=$(mktemp -d)
  for run in cold warm warm; do
    echo "$tokens token(s), $run: $(timed python -m deepinfer run --prompt Hello --max-tokens "$tokens" --no-progress) s" | tee -a "$R/cold_start.txt"
  done
done
