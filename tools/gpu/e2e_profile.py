"""Where a batch-1 decode step of the e2e model spends its time (GPU only): kernels by total time, graph launches.

python tools/gpu/e2e_profile.py [LAYERS]
"""

import sys

from torch.profiler import ProfilerActivity, profile

from deepinfer.bench import e2e

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
e2e.run(batches=(1,), layers=layers, with_hf=False, new_tokens=8)  # compile + capture outside the profile
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    results = e2e.run(batches=(1,), layers=layers, with_hf=False, new_tokens=16)
print(e2e.format_results(results))
table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)
print(table)
launches = [e for e in prof.key_averages() if "GraphLaunch" in e.key or "graph" in e.key.lower()]
for e in launches:
    print(f"{e.key}: {e.count} calls")
