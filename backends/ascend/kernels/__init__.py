"""The ascend backend's Triton kernels (written for triton-ascend, checked under community Triton's
interpreter), one module per op family. Each exports `REGISTRATIONS` (deepinfer.registry.Registration).
"""

from __future__ import annotations

import importlib

MODULES = ("norm", "rope", "activation", "kv_cache", "mla_decode", "prefill", "gemm", "moe", "sampling", "moe_ep")


def registrations():
    for name in MODULES:
        module = importlib.import_module(f"deepinfer_ascend.kernels.{name}")
        yield from module.REGISTRATIONS
