"""Where a decode step of the e2e model spends its time (GPU only): kernels by time per decode step.

python tools/gpu/e2e_profile.py [--layers N] [--batch B ...] [--deterministic] [--rows R]

Each batch gets its own engine (bench e2e's warm-up compiles and captures outside the profile). Two
profiled `bench e2e` runs that differ only in the tokens generated (1 and 16 after the prompt): each
kernel's time in the second minus its time in the first, over the decode steps between them, is its
time per decode step (prefill, model building and the copy-bandwidth probe cancel), so deterministic
mode's kernels can be set against the default's step by step. Not yet run on the H200 in this form.
"""

import argparse
from collections import Counter

from torch.profiler import ProfilerActivity, profile

from deepinfer.bench import e2e

NEW = 16


def kernel_times(prof) -> Counter:
    """Self device time (us) by kernel name (device events only)."""
    times = Counter()
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0)
        if us and event.key and not event.key.startswith(("aten::", "cuda", "cu")):
            times[event.key] += us
    return times


def profiled(batch: int, layers: int, deterministic: bool, new_tokens: int) -> Counter:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        e2e.run(batches=(batch,), layers=layers, with_hf=False, new_tokens=new_tokens, deterministic=deterministic)
    return kernel_times(prof)


parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--batch", type=int, action="append")
parser.add_argument("--deterministic", action="store_true")
parser.add_argument("--rows", type=int, default=25)
args = parser.parse_args()
for batch in args.batch or [1]:
    e2e.run(batches=(batch,), layers=args.layers, with_hf=False, new_tokens=8, deterministic=args.deterministic)  # compile, capture
    # e2e.run generates 1 and 1 + new_tokens tokens 4 times each (a warm-up, then 3 timed runs), and
    # builds the same model each time: two runs with new_tokens 1 and NEW differ by 4 x (NEW - 1) decode steps
    short = profiled(batch, args.layers, args.deterministic, 1)
    long = profiled(batch, args.layers, args.deterministic, NEW)
    steps = 4 * (NEW - 1)
    per_step = Counter({k: (long[k] - short.get(k, 0)) / steps for k in long})
    total = sum(v for v in per_step.values() if v > 0)
    print(f"### batch {batch}, deterministic={args.deterministic}: {total / 1e3:.3f} ms of kernels per decode step")
    for name, us in per_step.most_common(args.rows):
        print(f"  {us:9.1f} us  {us / total:6.1%}  {name[:100]}")
