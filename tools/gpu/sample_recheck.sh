#!/usr/bin/env bash
# On nvidia-h200 (repo root): the sample kernels' tests compiled on the GPU, their device-time profile and
# `bench ops --op sample`.
[ -n "$R" ] || source tools/gpu/preamble.sh
export TRITON_INTERPRET=0
step sample_tests 200 python -m pytest -q -p no:cacheprovider tests/cuda/test_sampling_kernels.py
tail -3 "$R/sample_tests.txt"
unset TRITON_INTERPRET
step sample_profile 150 python tools/gpu/sample_profile.py
grep "device total" "$R/sample_profile.txt"
grep "pass2" "$R/sample_profile.txt"
step sample_ops 200 python -m deepinfer bench ops --backend cuda --op sample --json "$R/sample_ops.json"
tail -10 "$R/sample_ops.txt" | cut -c1-160
