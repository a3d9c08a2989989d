"""Entry point of the cuda backend: declares it, registers its Triton kernels when selected."""

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
    from deepinfer_cuda.kernels import registrations  # imports triton: only once selected

    registry.register_all(NAME, registrations())


@hookimpl
def deepinfer_tuning_configs(backend, op, device_name):
    return None  # the tables in deepinfer_cuda.tuning serve; other plugins may override


@hookimpl
def deepinfer_env_report(backend):
    if backend.name != NAME:
        return None
    report = {"torch": torch.__version__, "cuda": str(torch.version.cuda), "triton": str(triton_version())}
    if torch.version.cuda is not None and torch.cuda.device_count() > 0:
        report["gpu0"] = torch.cuda.get_device_name(0)
    return report


# `deepinfer bench ops --backend cuda` runs this: ceilings, kernels and torch peers in one run.
BENCH_RUNNER = "deepinfer_cuda.bench.runner:run"
