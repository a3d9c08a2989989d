"""GPU benchmarks of the cuda backend's kernels at the shapes the issue's targets name.

One module per op family holds `CASES` and declares the `OPS` they bench and its `TABLE_ORDER`;
`runner.py` finds those modules by iterating this package, measures ceilings, kernels and torch
peers in one run and reports time, achieved rate, fraction of the ceiling and ratio to the peer.
Modules without OPS are helpers, and their docstrings say "Not a bench module".
"""
