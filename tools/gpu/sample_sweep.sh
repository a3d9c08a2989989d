#!/usr/bin/env bash
# cuda `sample` (chunked passes): the configuration sweep, then the kernel tests and the conformance
# cases on the GPU (run on nvidia-h200 in the repo root; $OUT comes back). Nothing carried.
#  1. python -m deepinfer_cuda.bench.sampling --sweep: the 5 bench cases (B256 top-k 50 + top-p 0.9,
#     greedy, temperature, top-p peaked; B16 top-k/top-p from a CUDA graph) x 5 chunk configurations
#     -> table, paths, the winner's tuning entry (sweep.txt) and sweep.json;
#  2. at the same time (after the sweep, so they do not disturb its timing): the compiled kernels
#     against the CPU reference (tests/cuda/test_sampling_kernels.py with TRITON_INTERPRET=0; a subset
#     by default, `sample_sweep.sh all` for every test: ~11 compiles of the finish kernel, minutes)
#     and `deepinfer conformance --backend cuda --op sample --op apply_token_bitmask`.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/sample_sweep_out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.txt" 2>&1 || echo "== install failed (see install.txt); trying the tree as it is"
step() { local name=$1; shift; local t=$SECONDS; timeout "$@" > "$OUT/$name.txt" 2>&1; echo "== $name rc=$? $((SECONDS - t)) s"; }
step sweep 240 python -m deepinfer_cuda.bench.sampling --sweep --json "$OUT/sweep.json"
cat "$OUT/sweep.txt" | tail -16
K=(-k "deepseek or every_parameter or batch_invariance or bitmask or registrations or forbidden")
[ "$1" = all ] && K=()
TRITON_INTERPRET=0 step pytest 400 python -m pytest -q -x tests/cuda/test_sampling_kernels.py "${K[@]}" &
step conformance 200 python -m deepinfer conformance --backend cuda --op sample --op apply_token_bitmask &
wait
tail -5 "$OUT/pytest.txt"; tail -3 "$OUT/conformance.txt"
