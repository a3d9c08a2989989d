#!/usr/bin/env bash
# Why is the eager 128-token dispatch host-bound on one rank? (nvidia-h200-x2, repo root)
# The same `bench ops --ep 2 --tokens 128` three times: as is; with each rank pinned to its own half
# of the CPUs (a sitecustomize that calls sched_setaffinity from LOCAL_RANK); and under py-spy-free
# timing of the Python launch cost (one rank, no GPU wait): tools/gpu/launch_cost.py.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p "$R"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 9; }
nproc; cat /proc/self/status | grep -i cpus_allowed_list; python -c "import os; print('affinity', len(os.sched_getaffinity(0)))"
mkdir -p /tmp/pin && cat > /tmp/pin/sitecustomize.py <<'PY'
import os
rank, n = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
cpus = sorted(os.sched_getaffinity(0)); per = max(1, len(cpus) // n)
os.sched_setaffinity(0, cpus[rank * per:(rank + 1) * per])
PY
B=(python -m deepinfer bench ops --backend cuda --op dispatch --op combine --ep 2 --tokens 128 --phases --repeat 50 --warmup 5)
for mode in plain pinned; do
  if [ $mode = pinned ]; then export PYTHONPATH=/tmp/pin; fi
  timeout 120 "${B[@]}" --json "$R/$mode.json" > "$R/$mode.txt" 2>&1; echo "== $mode rc=$?"
  grep -vE "^\[rank1\]" "$R/$mode.txt" | grep -E "^symmetric memory  .*(dispatch|combine) |^symmetric memory +128 dispatch|^all_to_all_single \(" | cut -c1-120
done
unset PYTHONPATH
timeout 60 python tools/gpu/launch_cost.py
