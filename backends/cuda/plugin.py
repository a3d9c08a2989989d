"""Entry point of the cuda backend: declares it, registers its kernels when selected."""

from __future__ import annotations

import torch

from deepinfer.plugins import BackendSpec, hookimpl
from deepinfer_cuda.probe import probe, triton_version

NAME = "cuda"


@hookimpl
def deepinfer_add_backends(register):
    register(
        BackendSpec(
            name=NAME,
            device_type="cuda",
            probe=probe,
            description="NVIDIA Hopper (SM90) and Blackwell (SM100): Triton kernels",
            kv_block_size=64,
            auto_priority=20,
        )
    )


@hookimpl
def deepinfer_register_kernels(backend, registry, interpret):
    if backend.name != NAME:
        return
    # The Triton kernels arrive with the CUDA-backend issue; until then this backend registers
    # none, and resolving it fails with an error naming each missing op (no silent fallback).


@hookimpl
def deepinfer_env_report(backend):
    if backend.name != NAME:
        return None
    report = {"torch": torch.__version__, "cuda": str(torch.version.cuda), "triton": str(triton_version())}
    return report
