"""The cuda backend's Triton kernels, one module per op family.

Each module exports `REGISTRATIONS`: a list of `Registration`s (op name, wrapper with the op's exact
signature, formats/dtypes it serves, a note for the coverage table). `plugin.py` registers them.
"""

from __future__ import annotations

import importlib

MODULES = ("norm", "rope", "activation", "kv_cache", "mla_decode", "prefill", "gemm", "moe", "sampling", "moe_ep", "moe_ep_symm")


def registrations():
    for name in MODULES:
        module = importlib.import_module(f"deepinfer_cuda.kernels.{name}")
        yield from module.REGISTRATIONS
