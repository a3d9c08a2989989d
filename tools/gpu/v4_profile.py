"""Where a V4-Flash-shaped decode step goes (H200, torch profiler): `deepinfer bench e2e --model-shape
v4-flash`'s model cut to a few layers, batch 1 and 64 at context 4096, the top kernels and CPU ops.

    python tools/gpu/v4_profile.py [--layers 4]
"""

from __future__ import annotations

import argparse

from torch.profiler import ProfilerActivity, profile

from deepinfer.bench import e2e_v4

parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, default=4)
args = parser.parse_args()
for batch in (1, 64):
    e2e_v4.run("cuda", batches=(batch,), contexts=(4096,), steps=2, layers=args.layers)  # compile and warm everything
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        results, _ = e2e_v4.run("cuda", batches=(batch,), contexts=(4096,), steps=8, layers=args.layers)
    print(f"batch {batch}: {results[0].step_ms:.2f} ms per step over {args.layers} layers")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
