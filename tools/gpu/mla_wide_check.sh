#!/usr/bin/env bash
# On nvidia-h200 (repo root): mla_decode's wide combine. The small-batch sweep (tools/gpu/mla_small_batch_sweep.py),
# the mla_decode kernel tests compiled on the GPU, `bench ops --op mla_decode` (the new long-context rows); carry .whl
# for the last step, `bench structured` again.
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
step mla_sweep 330 python tools/gpu/mla_small_batch_sweep.py
grep -v Warning "$R/mla_sweep.txt" | tail -80
export TRITON_INTERPRET=0
step mla_tests 200 python -m pytest -q -p no:cacheprovider tests/cuda/test_attention_kernels.py -k "mla"
tail -3 "$R/mla_tests.txt"
unset TRITON_INTERPRET
step mla_ops 200 python -m deepinfer bench ops --backend cuda --op mla_decode --json "$R/mla_ops.json"
tail -28 "$R/mla_ops.txt"
# and structured output's overhead once more (run-to-run spread of the 100%-constrained figure)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/structured/*.whl >/dev/null 2>&1 || echo "llguidance wheel failed"
step structured 300 python -m deepinfer bench structured --backend cuda --model-shape v2-lite --layers 8 --json "$R/structured.json"
tail -6 "$R/structured.txt"
