#!/usr/bin/env bash
# Expert parallelism on two GPUs of one host (repo root on a lent 2-GPU machine; carry .whl): the golden
# dispatch/combine cases split over 2 ranks through both cuda exchange paths (symmetric memory and NCCL's
# all_to_all_single: each must print "16 pass"), then `deepinfer run --ep 2` on the tiny model, float32,
# greedy, with CUDA graphs and with --enforce-eager: the two outputs must be identical. About 4 minutes.
source tools/gpu/preamble.sh
unset TRITON_INTERPRET
MR=(python -m deepinfer_conformance.multirank --backend cuda --ep 2 --timeout 60)
step conformance_symm 150 "${MR[@]}" --ep-path symm --json "$R/conformance_symm.json" &
step conformance_nccl 150 "${MR[@]}" --ep-path nccl --json "$R/conformance_nccl.json" &
wait
python - > "$R/prompts.jsonl" <<'PY'
import json
for i in range(16):
    print(json.dumps({"id": i, "prompt": f"Question {i}: what is {i} times {i + 3}? Explain step by step.", "max_tokens": 48}))
PY
RUN=(python -m deepinfer run --backend cuda --ep 2 --dtype float32 --temperature 0 --ignore-eos --no-progress -i "$R/prompts.jsonl")
step run_graphs 150 "${RUN[@]}" -o "$R/out_graphs.jsonl"
step run_eager 120 "${RUN[@]}" --enforce-eager -o "$R/out_eager.jsonl"
python - "$R" <<'PY'
import json, sys
rows = {name: [json.loads(line) for line in open(f"{sys.argv[1]}/out_{name}.jsonl")] for name in ("graphs", "eager")}
same = sum(g.get("token_ids", g.get("text")) == e.get("token_ids", e.get("text")) for g, e in zip(rows["graphs"], rows["eager"]))
print(f"graphs vs eager: {same} of {len(rows['eager'])} outputs identical")
PY
for f in conformance_symm conformance_nccl; do echo "$f: $(tail -1 "$R/$f.txt")"; done
