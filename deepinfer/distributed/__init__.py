"""Multi-device runs on torch.distributed: the process group (`group`) and expert parallelism
(`expert_parallel`). One process per device, launched by torchrun; NCCL on cuda, HCCL on npu, gloo
on the CPU. Nothing here starts a transport of its own."""

from deepinfer.distributed.expert_parallel import ExpertParallel, as_expert_parallel, ep_size_of
from deepinfer.distributed.group import (
    DistContext,
    DistributedError,
    default_device_type,
    destroy_distributed,
    free_port,
    init_distributed,
    rank_env,
)

__all__ = [
    "DistContext",
    "DistributedError",
    "ExpertParallel",
    "as_expert_parallel",
    "default_device_type",
    "destroy_distributed",
    "ep_size_of",
    "free_port",
    "init_distributed",
    "rank_env",
]
