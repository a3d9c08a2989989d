"""Kernel configurations for sm90: {op: {variant: {BLOCK_M: ..., num_warps: ..., num_stages: ...}}}.

Kernel modules add their entries here; an op/variant missing here falls back to default.py.
"""

CONFIGS: dict[str, dict[str, dict]] = {}
