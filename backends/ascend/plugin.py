"""Entry point of the ascend backend: declares it, registers its kernels when selected.

Light: importing it (every command that loads plugins does) imports neither torch nor torch_npu; the
functions that need them import them when called.
"""

from __future__ import annotations

import importlib.metadata

from deepinfer.plugins import BackendSpec, hookimpl
from deepinfer_ascend.options import OPTIONS
from deepinfer_ascend.probe import device_count, probe

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
            options=OPTIONS,
            memory_info=memory_info,
            device_count=device_count,
            async_execution=True,  # kernels queue on NPU streams (not run on hardware here)
            compiles_on_first_use=True,  # triton-ascend compiles each kernel specialisation on its first call
            # graph_capture: not declared. torch_npu's NPUGraph (aclgraph) has the CUDA-graph API
            # (deepinfer.device_graphs.TorchGraphCapture("npu", "NPUGraph", import_first="torch_npu")), but it
            # has never run here; docs/backends/ascend.md says what must be checked on hardware first.
        )
    )


def memory_info(device) -> tuple[int, int]:
    """(free, total) bytes of an NPU, for the KV cache budget (torch.npu: added by torch_npu, which the probe imported)."""
    import torch

    return torch.npu.mem_get_info(device)


@hookimpl
def deepinfer_register_kernels(backend, registry, interpret, options):
    if backend.name != NAME:
        return
    if interpret:
        from deepinfer_ascend.device import simulate

        simulate(options["sim_chip"])  # the chip the kernels size themselves by (validated option)
    from deepinfer_ascend.kernels import registrations  # imports triton: only once selected

    registry.register_all(NAME, registrations())
    if not interpret:
        # torch_npu fast paths, hardware only; chosen only under the option npu_fast_paths (default off).
        from deepinfer_ascend.npu_ops import registrations as npu_registrations

        registry.register_all(NAME, npu_registrations())


@hookimpl
def deepinfer_env_report(backend):
    if backend.name != NAME:
        return None
    import torch

    versions = {"torch": torch.__version__}
    for dist in ("torch-npu", "triton-ascend"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    return versions
