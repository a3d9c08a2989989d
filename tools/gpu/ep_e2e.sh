#!/usr/bin/env bash
# End to end: expert-parallel decode scaling on one host (run on nvidia-h200-x2 in the repo
# root; $OUT comes back). A random DeepSeek-V3-shaped model cut to 4 layers (1 dense + 3 MoE, all
# 256 experts, bf16), skewed routing; EP 1 (CUDA graphs on, then eager), EP 2 without and with 32
# EPLB redundant experts; batch 64 and 256 per GPU. No tokenizer, no network, nothing carried.
# EP 2 exchanges rows over the cuda backend's symmetric-memory path (one host); `ep_e2e.sh nccl`
# also runs EP 2 over NCCL's all_to_all_single (DEEPINFER_EP_PATH=nccl; ~1 minute more).
# Memory at EP 1: 3 MoE layers x 21 GiB of experts + 5.9 GiB else (68.9 GiB); building a MoE layer
# briefly takes another ~35 GiB (per-expert draws, stacked, fused): ~104 GiB peak on a 141 GB H200.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 9; }
step() { local name=$1; shift; local t=$SECONDS; timeout "$@" > "$OUT/$name.txt" 2>&1; echo "== $name rc=$? $((SECONDS - t)) s"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } > "$OUT/machine.txt" 2>&1
COMMON=(--batch 64 --batch 256 --prompt-len 128 --new-tokens 32 --skew 0.5)
step ep1 180 python -m deepinfer bench e2e-ep --ep 1 "${COMMON[@]}" --json "$OUT/ep1.json"
tail -4 "$OUT/ep1.txt"
step ep2 180 python -m deepinfer bench e2e-ep --ep 2 "${COMMON[@]}" --num-redundant-experts 0 --num-redundant-experts 32 --json "$OUT/ep2.json"
grep -v "^\[rank1\]" "$OUT/ep2.txt" | tail -7
step ep1_eager 120 python -m deepinfer bench e2e-ep --ep 1 "${COMMON[@]}" --enforce-eager --json "$OUT/ep1_eager.json"
tail -3 "$OUT/ep1_eager.txt"
if [ "${1:-}" = nccl ]; then
  step ep2_nccl 150 env DEEPINFER_EP_PATH=nccl python -m deepinfer bench e2e-ep --ep 2 "${COMMON[@]}" --num-redundant-experts 0 --num-redundant-experts 32 --json "$OUT/ep2_nccl.json"
  grep -v "^\[rank1\]" "$OUT/ep2_nccl.txt" | tail -7
fi
head -3 "$OUT/machine.txt"
