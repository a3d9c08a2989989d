#!/usr/bin/env bash
# On nvidia-h200 (repo root): mla_decode's kernel tests compiled on the GPU and `bench ops --op mla_decode`
# (after a refactor of its combine kernels).
source tools/gpu/preamble.sh
export TRITON_INTERPRET=0
step mla_tests 200 python -m pytest -q -p no:cacheprovider tests/cuda/test_attention_kernels.py -k "mla"
tail -3 "$R/mla_tests.txt"
unset TRITON_INTERPRET
step mla_ops 200 python -m deepinfer bench ops --backend cuda --op mla_decode --json "$R/mla_ops.json"
tail -25 "$R/mla_ops.txt" | cut -c1-110
