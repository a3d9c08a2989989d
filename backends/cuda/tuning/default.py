"""Default kernel configurations (any device, the interpreter included): {op: {variant: {...}}}.

Kernel modules add their entries here; an op/variant missing here falls back to default.py.
"""

CONFIGS: dict[str, dict[str, dict]] = {}
