"""GPU benchmarks of the cuda backend's kernels at the shapes the issue's targets name.

One module per op family holds `CASES`; `runner.py` measures ceilings, kernels and torch peers
in one run and reports time, achieved rate, fraction of the ceiling and ratio to the peer.
"""
