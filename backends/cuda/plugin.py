"""Entry point of the cuda backend: declares it, registers its Triton kernels when selected.

Light: importing it (every command that loads plugins does) imports no torch; the functions that
need torch import it when called.
"""

from __future__ import annotations

from deepinfer.device_graphs import TorchGraphCapture
from deepinfer.plugins import BackendSpec, hookimpl
from deepinfer_cuda.options import OPTIONS, PDL
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
def deepinfer_register_kernels(backend, registry, options):
    if backend.name != NAME:
        return
    from deepinfer_cuda.kernels import registrations  # imports triton: only once selected

    registry.register_all(NAME, with_pdl_option(registrations(), options.get(PDL.name, PDL.default)))


def with_pdl_option(registrations, pdl: str):
    """The registrations as backend option `pdl` wants them. PDL is how every kernel is launched, not
    a choice between kernels, so the option is applied here, once, rather than by a `when` on a
    second copy of every registration: auto leaves them as they are (each launch takes PDL where it
    can run); off wraps every kernel so that its launches go without; on is auto, and every kernel
    says at resolve where PDL cannot run (`unusable`: a one-line error, as ep_path=symm's)."""
    from dataclasses import replace

    from deepinfer_cuda.kernels.common import pdl_unavailable, without_pdl

    registrations = list(registrations)  # (a generator, read more than once below)
    if pdl == "on":

        def unusable(own):
            def reason(ctx):
                why = pdl_unavailable(ctx.device)
                if why is not None:
                    return f"backend option pdl=on, but PDL cannot run here: {why} (pdl=auto or off)"
                return own(ctx) if own is not None else None

            return reason

        return [replace(r, unusable=unusable(r.unusable)) for r in registrations]
    if pdl == "off":
        wrapped = {}  # one wrapper per kernel function: registrations that share a function still share one
        for r in registrations:
            if r.fn not in wrapped:
                wrapped[r.fn] = without_pdl(r.fn)
        return [replace(r, fn=wrapped[r.fn]) for r in registrations]
    return registrations


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
