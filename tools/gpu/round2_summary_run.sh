#!/usr/bin/env bash
# On nvidia-h200 (repo root): the second kernel round's rows in one run (`bench ops` for mla_decode, prefill,
# grouped_gemm, sample, dispatch, combine; copy and matmul ceilings measured by the runner in the same run),
# then the touched ops' golden cases compiled (`deepinfer conformance --backend cuda`).
source tools/gpu/preamble.sh
step ops 420 python -m deepinfer bench ops --backend cuda --op mla_decode --op prefill --op grouped_gemm --op sample --op dispatch --op combine --json "$R/ops.json"
grep -E "copy|matmul|mla_decode|prefill|grouped|sample|dispatch|combine" "$R/ops.txt" | cut -c1-170 | tail -60
step conformance 150 python -m deepinfer conformance --backend cuda --op sample --op dispatch --op combine --op rejection_sample
tail -4 "$R/conformance.txt"
