#!/usr/bin/env bash
# The cuda backend's correctness on one GPU, after a change to kernels or the engine (repo root on a lent
# one-GPU machine; carry .whl). Every golden case compiled and run (and the MX GEMM cases with each forced
# path), the GPU-only tests (float32 tokens = the reference's, bf16 as close as the reference's own bf16,
# CUDA-graph decode = eager, sampling options, deterministic mode's bit-identity), an op family from outside
# the tree (the out-of-tree fixture's Triton softcap) and a tiny-model run. About 8 minutes on an H200.
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
step conformance 400 python -m deepinfer conformance --backend cuda --quiet --json "$R/conformance.json" & CONFORMANCE=$!
step gpu_tests 480 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider tests/cuda/test_end_to_end.py tests/engine/test_deterministic_kernels_cuda.py
wait $CONFORMANCE
for path in upcast dot_scaled; do
  step "mxfp4_$path" 150 python -m deepinfer conformance --backend cuda --backend-option "mxfp4_path=$path" --op linear --op grouped_gemm --quiet
done
cp -r tests/fixtures/oot_extension /tmp/oot_src && python -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/oot /tmp/oot_src >/dev/null 2>&1
step oot_softcap 120 env PYTHONPATH="/tmp/oot:${PYTHONPATH:-}" python -m deepinfer conformance --backend cuda --op softcap
step run_tiny 120 python -m deepinfer run --backend cuda --prompt "The capital of France is" --max-tokens 32 --temperature 0 --no-progress
for f in conformance mxfp4_upcast mxfp4_dot_scaled oot_softcap; do echo "$f: $(tail -1 "$R/$f.txt")"; done
tail -3 "$R/gpu_tests.txt"; tail -4 "$R/run_tiny.txt"
