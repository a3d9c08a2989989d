"""Where a decode step of the e2e model spends its time (GPU only): kernels by total time, per batch size.

python tools/gpu/e2e_profile.py [--layers N] [--batch B ...] [--deterministic]

Each batch gets its own engine (bench e2e's warm-up compiles and captures outside the profile); the
table lists the kernels of 16 decode steps plus one prefill, by self CUDA time, so the deterministic
mode's kernels can be set against the default's.
"""

import argparse

from torch.profiler import ProfilerActivity, profile

from deepinfer.bench import e2e

parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--batch", type=int, action="append")
parser.add_argument("--deterministic", action="store_true")
parser.add_argument("--rows", type=int, default=25)
args = parser.parse_args()
for batch in args.batch or [1]:
    e2e.run(batches=(batch,), layers=args.layers, with_hf=False, new_tokens=8, deterministic=args.deterministic)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        results = e2e.run(batches=(batch,), layers=args.layers, with_hf=False, new_tokens=16, deterministic=args.deterministic)
    print(f"### batch {batch}, deterministic={args.deterministic}")
    print(e2e.format_results(results))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=90))
