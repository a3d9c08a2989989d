#!/usr/bin/env bash
# On nvidia-h200 (repo root): the sample kernels compiled against the reference, their profile and bench rows
# with the tuning tables' entries (sample_recheck.sh), then the follow-up probe (sample's second-pass program
# count, dispatch's counting sort) and the dispatch/combine bench rows.
source tools/gpu/preamble.sh
source tools/gpu/sample_recheck.sh
step followup 200 python tools/gpu/sample_dispatch_probe.py --followup
cut -c1-220 "$R/followup.txt"
step moe_ops 120 python -m deepinfer bench ops --backend cuda --op dispatch --op combine --json "$R/moe_ops.json"
tail -5 "$R/moe_ops.txt" | cut -c1-160
