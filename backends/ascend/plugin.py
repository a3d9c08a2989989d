"""Entry point of the ascend backend: declares it, registers its kernels when selected."""

from __future__ import annotations

import importlib.metadata

import torch

from deepinfer.plugins import BackendSpec, hookimpl
from deepinfer_ascend.probe import probe

NAME = "ascend"


@hookimpl
def deepinfer_add_backends(register):
    register(
        BackendSpec(
            name=NAME,
            device_type="npu",
            probe=probe,
            description="Huawei Ascend A2/A3 and 950: triton-ascend kernels and torch_npu fused ops",
            kv_block_size=128,
            auto_priority=10,
        )
    )


@hookimpl
def deepinfer_register_kernels(backend, registry, interpret):
    if backend.name != NAME:
        return
    from deepinfer_ascend.kernels import registrations  # imports triton: only once selected

    registry.register_all(NAME, registrations())
    if not interpret:
        from deepinfer_ascend.npu_ops import registrations as npu_registrations  # torch_npu fast paths, hardware only

        registry.register_all(NAME, npu_registrations())


@hookimpl
def deepinfer_env_report(backend):
    if backend.name != NAME:
        return None
    versions = {"torch": torch.__version__}
    for dist in ("torch-npu", "triton-ascend"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    return versions
