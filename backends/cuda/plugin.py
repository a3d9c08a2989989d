"""Entry point of the cuda backend: declares it, registers its Triton kernels when selected.

Light: importing it (every command that loads plugins does) imports no torch; the functions that
need torch import it when called.
"""

from __future__ import annotations

from deepinfer.device_graphs import TorchGraphCapture
from deepinfer.plugins import BackendSpec, hookimpl
from deepinfer_cuda.options import OPTIONS
from deepinfer_cuda.probe import device_count, probe, triton_version

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
            options=OPTIONS,
            graph_capture=TorchGraphCapture("cuda", "CUDAGraph"),  # decode steps replay as CUDA graphs
            async_execution=True,  # kernels queue on CUDA streams: the engine overlaps scheduling with them
            compiles_on_first_use=True,  # Triton compiles each kernel specialisation on its first call
            memory_info=memory_info,
            device_count=device_count,
            profiler_activity="CUDA",  # `bench e2e --profile`: torch.profiler records the CUDA kernels
            bench_runner="deepinfer_cuda.bench.runner:run",  # `bench ops --backend cuda`: ceilings, kernels and torch peers
        )
    )


def memory_info(device) -> tuple[int, int]:
    """(free, total) bytes of a GPU, for the KV cache budget."""
    import torch

    return torch.cuda.mem_get_info(device)


@hookimpl
def deepinfer_register_kernels(backend, registry, interpret):
    if backend.name != NAME:
        return
    from deepinfer_cuda.kernels import registrations  # imports triton: only once selected

    registry.register_all(NAME, registrations())


@hookimpl
def deepinfer_env_report(backend):
    if backend.name != NAME:
        return None
    import torch

    report = {"torch": torch.__version__, "cuda": str(torch.version.cuda), "triton": str(triton_version())}
    if device_count() > 0:
        report["gpu0"] = torch.cuda.get_device_name(0)
    return report


@hookimpl
def deepinfer_add_bench_commands(add):
    from deepinfer_cuda.bench.compile_command import add_compile_command

    add_compile_command(add)  # `deepinfer bench compile`: AOT compile check for SM90/SM100, no GPU needed
