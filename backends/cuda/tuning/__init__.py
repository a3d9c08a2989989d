"""Per-architecture kernel configurations (tile shapes, warps, stages), with a default fallback.

`config(op, variant, device)` looks up the table for the device's compute capability (sm100.py,
sm90.py), then `default.py`. The tables are this backend's own: a new entry or a new architecture
is an edit here (docs/architecture.md says why there is no plugin hook for them).
"""

from __future__ import annotations

import importlib
from functools import lru_cache

import torch

from deepinfer_cuda.kernels.common import capability

TABLES = {(10, 0): "sm100", (9, 0): "sm90"}


@lru_cache(maxsize=None)
def _table(name: str) -> dict:
    return importlib.import_module(f"deepinfer_cuda.tuning.{name}").CONFIGS


def config(op: str, variant: str, device: torch.device | None) -> dict:
    """The configuration for `op`/`variant` on `device`: the arch table's entry, else the default."""
    arch = TABLES.get(capability(device))
    if arch is not None:
        entry = _table(arch).get(op, {}).get(variant)
        if entry is not None:
            return dict(entry)
    entry = _table("default").get(op, {}).get(variant)
    if entry is None:
        raise KeyError(f"no tuning entry for {op}/{variant}")
    return dict(entry)

