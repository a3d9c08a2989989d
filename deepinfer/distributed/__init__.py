"""Multi-device runs on torch.distributed: the process group and its failures (`group`), expert
parallelism (`expert_parallel`), EPLB (`eplb`: the policy; `eplb_schedule`: during a run), and the
ranks' lockstep steps (`step_agreement`: what they agree on before a step; `lockstep`: one rank's
part of it). One process per device, launched by torchrun; NCCL on cuda, HCCL on npu, gloo on the
CPU. Nothing here starts a transport of its own."""

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
