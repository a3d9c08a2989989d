"""Expert-parallel `dispatch` / `combine` for the cuda backend: tokens cross ranks by all_to_all_single.

The local work is the Triton kernels of `deepinfer_cuda.kernels.moe` (the counting-sort dispatch
that yields this rank's send layout, and the fixed-order combine); the rows travel between ranks
with torch.distributed's `all_to_all_single` over the ep_group's process group
(`deepinfer.distributed.ExpertParallel.exchange_dispatch` / `exchange_combine`): NCCL on GPUs, and
whatever library the group has otherwise (gloo on CPU tensors under TRITON_INTERPRET=1, which is
how CI checks this module on a machine without GPUs). The split sizes are exchanged once per
dispatch (one all_to_all of the per-expert counts, one host synchronisation to size the receive
buffer), as the op's contract says.

Registered with `when=ctx.ep_size > 1` and priority EP_PRIORITY, above the local kernels (which
refuse a group of several ranks), so resolving the ops with ep_size > 1 picks these. With ep_group
None or a one-rank group they are the local kernels.

Not here yet (Future plan): an intranode path that writes rows straight into the peers' receive
buffers (torch symmetric memory over NVLink) instead of NCCL's all_to_all, selected by the registry
(a higher priority and a `when` on the topology) and checked by the same conformance cases.
"""

from __future__ import annotations

import torch

from deepinfer.distributed.expert_parallel import as_expert_parallel
from deepinfer_cuda.kernels import moe as local
from deepinfer_cuda.kernels.common import Registration

EP_PRIORITY = 100  # above every local dispatch/combine kernel


def dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    num_experts: int,
    ep_group: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ep = as_expert_parallel(ep_group, num_experts)
    send_x, send_offsets, row_of_slot = local.dispatch(x, topk_ids, num_experts=num_experts)
    if ep is None:
        return send_x, send_offsets, row_of_slot
    expert_x, expert_offsets = ep.exchange_dispatch(send_x, send_offsets, row_of_slot)
    return expert_x, expert_offsets, row_of_slot


def combine(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    row_of_slot: torch.Tensor,
    *,
    ep_group: object | None = None,
) -> torch.Tensor:
    ep = as_expert_parallel(ep_group)
    if ep is not None:
        expert_out = ep.exchange_combine(expert_out, row_of_slot)  # this rank's slots, in its send layout
    return local.combine(expert_out, topk_weights, row_of_slot)


def _expert_parallel(ctx) -> bool:
    return ctx.ep_size > 1


REGISTRATIONS = [
    Registration(op="dispatch", fn=dispatch, when=_expert_parallel, priority=EP_PRIORITY,
                 note="Triton counting sort + torch.distributed all_to_all_single (NCCL) across the EP group"),
    Registration(op="combine", fn=combine, when=_expert_parallel, priority=EP_PRIORITY,
                 note="torch.distributed all_to_all_single (NCCL) back to the sources + Triton fixed-order combine"),
]
