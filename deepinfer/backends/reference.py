"""The reference backend: every op's pure-torch definition, on any torch device, the CPU included.

It registers through the same hooks and entry point as every other backend. Its kernels are the
ops' reference functions themselves, so it is complete by construction and is the yardstick the
conformance suite measures the others with. Each op has a second, batch-invariant kernel for
deterministic mode: the same function with every sum computed exactly (`deepinfer/exact_order.py`).
"""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING

from deepinfer.plugins import Availability, BackendSpec, hookimpl

if TYPE_CHECKING:
    from deepinfer.registry import Registry

NAME = "reference"


def probe(interpret: bool = False) -> Availability:
    import torch  # here, not at the top: declaring the backend imports no torch

    return Availability(True, f"pure torch {torch.__version__} on the CPU", details={"device": "cpu"})


@hookimpl
def deepinfer_add_backends(register):
    register(
        BackendSpec(
            name=NAME,
            device_type="cpu",
            probe=probe,
            description="pure-torch definitions of every op; runs anywhere (slow)",
            kv_block_size=16,
            auto_priority=0,
            bench_scale="host",  # a CPU: benchmarks default to workloads a few cores finish in minutes
        )
    )


@hookimpl
def deepinfer_register_kernels(backend: BackendSpec, registry: Registry, interpret: bool):
    if backend.name != NAME:
        return
    from deepinfer.exact_order import invariant

    for name, spec in registry.ops.items():
        registry.register_kernel(NAME, name, spec.reference, note="pure torch")
        # Deterministic mode's kernel: the same definition with every sum exact (deepinfer/exact_order.py).
        registry.register_kernel(NAME, name, invariant(spec.reference), note="pure torch, exact sums", priority=-1, batch_invariant=True)


@hookimpl
def deepinfer_env_report(backend: BackendSpec):
    if backend.name != NAME:
        return None
    import torch

    from deepinfer.engine.cpu_threads import cpu_threads_for

    # what `deepinfer run` sets on the CPU (--cpu-threads aside), not this process's torch default
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu threads": str(cpu_threads_for(None, on_cpu=True))}
