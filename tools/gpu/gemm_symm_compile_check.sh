#!/usr/bin/env bash
# On nvidia-h200-x2 (repo root): the gemm conformance cases, the symmetric-memory EP conformance,
# the SM90/SM100 compile check and the EP benchmark. Results come back as one archive ($OUT/results.tar.gz).
source tools/gpu/preamble.sh  # env, installs, step, pack
MR=(python -m deepinfer_conformance.multirank --backend cuda --ep 2 --timeout 60)
step conformance_symm 100 "${MR[@]}" --ep-path symm --json "$R/conformance_symm.json" &
(export CUDA_VISIBLE_DEVICES=0; step conformance_gemm 150 python -m deepinfer conformance --backend cuda --op linear --op grouped_gemm --quiet --json "$R/conformance_gemm.json") &
step compile 150 python -m deepinfer bench compile --arch sm90,sm100 --json "$R/compile.json" &
wait
tail -1 "$R/conformance_symm.txt"; tail -2 "$R/conformance_gemm.txt"; tail -4 "$R/compile.txt"
step ep_bench 130 python -m deepinfer bench ops --backend cuda --op dispatch --op combine --ep 2 --phases --repeat 50 --warmup 5 --json "$R/ep_bench.json"
grep -vE "^\[rank1\]|^  " "$R/ep_bench.txt" | tail -42
