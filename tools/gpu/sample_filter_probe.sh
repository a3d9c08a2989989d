#!/usr/bin/env bash
# On nvidia-h200 (repo root): the filtered rows' first pass, before and after the split into two kernels
# (tools/gpu/sample_dispatch_probe.py --filter).
source tools/gpu/preamble.sh
step filter_probe 400 python tools/gpu/sample_dispatch_probe.py --filter
cut -c1-230 "$R/filter_probe.txt"
