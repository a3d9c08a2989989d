#!/usr/bin/env bash
# One call on nvidia-h200 (repo root): deterministic mode on the cuda backend. Conformance of the
# batch-invariant kernels, the bit-identity checks and the cross-backend logits
# (tools/gpu/deterministic_check.py), and the decode throughput of deterministic mode against the
# default at batch 1, 64 and 256 (bench e2e, V2-Lite-shaped random model, no HF peer).
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
step conformance 300 python -m deepinfer conformance --backend cuda --deterministic --quiet --json "$R/conformance.json"
step identity 900 python tools/gpu/deterministic_check.py --json "$R/identity.json"
step e2e_tests 400 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider tests/engine/test_deterministic_kernels.py -k cuda
step e2e_default 400 python -m deepinfer bench e2e --backend cuda --no-hf --batch 1 --batch 64 --batch 256 --json "$R/e2e_default.json"
step e2e_deterministic 400 python -m deepinfer bench e2e --backend cuda --no-hf --batch 1 --batch 64 --batch 256 --deterministic --json "$R/e2e_deterministic.json"
tail -1 "$R/conformance.txt"; tail -9 "$R/identity.txt"; tail -1 "$R/e2e_tests.txt"; tail -4 "$R/e2e_default.txt"; tail -4 "$R/e2e_deterministic.txt"
