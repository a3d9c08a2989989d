#!/usr/bin/env bash
# Expert-parallel dispatch/combine on one host (run on nvidia-h200-x2 in the repo root;
# $OUT comes back). Nothing carried, no network.
#  1. multi-rank conformance (golden dispatch/combine cases split over 2 ranks, NCCL process group)
#     through both EP paths of the cuda backend: symmetric memory (DEEPINFER_EP_PATH=symm: an
#     error, not a fallback, if it cannot run) and all_to_all_single over NCCL (=nccl); the two run
#     at the same time (small cases), each must print "16 pass";
#  2. `deepinfer bench ops --ep 2 --phases`: p2p bandwidth GPU0->GPU1, then dispatch/combine of both
#     paths and a plain all_to_all_single at 128 and 4096 tokens per rank, bf16 and fp8 rows (iterations
#     back to back, CUDA events around each op), then once more per bf16 row with an event at the end
#     of each phase of each path (send, barrier, expand, ...) -> ep_bench.json. (Superseded by ep2_conformance_bench_e2e.sh.)
# Runs in well under 4 minutes (conformance <= 110 s, both paths at once; bench <= 110 s).
# A failing step does not stop the others; each step's output is in $OUT/<step>.txt.
# NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0).
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/ep_bench_out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.txt" 2>&1 || echo "== install failed (see install.txt); trying the tree as it is"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } > "$OUT/machine.txt" 2>&1
step() { local name=$1; shift; local t=$SECONDS; timeout "$@" > "$OUT/$name.txt" 2>&1; echo "== $name rc=$? $((SECONDS - t)) s"; }
MR=(python -m deepinfer_conformance.multirank --backend cuda --ep 2 --timeout 60)
step conformance_symm 110 "${MR[@]}" --ep-path symm --json "$OUT/conformance_symm.json" &
step conformance_nccl 110 "${MR[@]}" --ep-path nccl --json "$OUT/conformance_nccl.json" &
wait
for f in conformance_symm conformance_nccl; do echo "-- $f"; grep -vE " pass " "$OUT/$f.txt" | tail -8; done
step bench 110 python -m deepinfer bench ops --backend cuda --op dispatch --op combine --ep 2 --repeat 50 --warmup 5 --phases --json "$OUT/ep_bench.json"
sed -n '/^expert-parallel dispatch/,$p' "$OUT/bench.txt" | grep -vE "^\[rank1\]"
grep -E "Error|error" "$OUT/bench.txt" | head -5
head -3 "$OUT/machine.txt"
