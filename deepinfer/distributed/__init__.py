"""Multi-device runs on torch.distributed: the process group and its failures (`group`), expert
parallelism (`expert_parallel`), EPLB (`eplb`: the policy; `eplb_schedule`: during a run), and the
ranks' lockstep steps (`step_agreement`: what they agree on before a step; `lockstep`: one rank's
part of it). One process per device, launched by torchrun; NCCL on cuda, HCCL on npu, gloo on the
CPU. Nothing here starts a transport of its own.

The names below are imported on first use, so that importing a torch-free module of the package
(`environment`: what the command line checks before it starts) does not import torch."""

import importlib

_LAZY_EXPORTS = {
    "ExpertParallel": "expert_parallel",
    "as_expert_parallel": "expert_parallel",
    "ep_size_of": "expert_parallel",
    "DistContext": "group",
    "DistributedError": "environment",
    "default_device_type": "group",
    "destroy_distributed": "group",
    "free_port": "environment",
    "init_distributed": "group",
    "rank_env": "environment",
}

__all__ = sorted(_LAZY_EXPORTS)


def __getattr__(name: str):
    if name in _LAZY_EXPORTS:
        value = getattr(importlib.import_module(f"deepinfer.distributed.{_LAZY_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'deepinfer.distributed' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_EXPORTS))
