"""Expert-parallel `dispatch` / `combine` for the ascend backend: tokens cross ranks by all_to_all_single.

The local work is the Triton kernels of `deepinfer_ascend.kernels.moe` (the counting-sort dispatch
that yields this rank's send layout, and the fixed-order combine); the rows travel between ranks
with torch.distributed's `all_to_all_single` over the ep_group's process group
(`deepinfer.distributed.ExpertParallel.exchange_dispatch` / `exchange_combine`): HCCL on Ascend
devices, and whatever library the group has otherwise (gloo on CPU tensors under TRITON_INTERPRET=1,
which is how CI checks this module without Ascend hardware). The split sizes are exchanged once per
dispatch (one all_to_all of the per-expert counts, one host synchronisation to size the receive
buffer). This is the checked path; HCCL itself has not run here (no Ascend host was available).

Built by `deepinfer.distributed.expert_parallel.expert_parallel_kernels`: registered with
`when=ctx.ep_size > 1` and priority EP_PRIORITY, above the local Triton kernels
(priority 0, which refuse a group of several ranks) and the torch_npu fast paths (npu_ops.PRIORITY),
so resolving the ops with ep_size > 1 picks these. With ep_group None or a one-rank group they are
the local Triton kernels.

NOT IMPLEMENTED: the `torch_npu.npu_moe_distribute_dispatch_v2` / `npu_moe_distribute_combine_v2`
fast path (CANN's fused quantise + EP alltoallv [+ TP allgatherv] and its inverse with the weighted
sum, as vllm-ascend uses on A2/A3). No Ascend hardware was available to write it faithfully.
  Why not yet: (1) its outputs do not carry this op's contract as documented: dispatch returns the
    received rows (`expand_x`) plus an opaque `assist_info_for_combine`, not a send-layout
    `row_of_slot`, and the order of rows within a local expert (source rank, then slot order, which
    the conformance suite checks exactly) is not documented; (2) combine_v2 applies the weights and
    sums inside the fused op, in an order the op does not document, where the contract fixes a
    k = 0..K-1 float32 sum; (3) documented limits: hidden size 7168 only on A3 and at most 7168
    (a multiple of 32) on A2, at most 256 (A2) / 512 (A3) tokens per rank, top_k <= 8, a group
    named by its HCCL communicator name (`group_ep`), HCCL_BUFFSIZE sized for the exchange.
  How it would fit: a kernel registered with a `when` that requires hardware (not interpreting, an
    A2/A3 chip, torch_npu having the op), ep_size > 1, the documented shape limits, and priority
    above EP_PRIORITY; dispatch keeps what combine_v2 needs (assist_info_for_combine,
    ep_recv_counts, expert ids and scales) inside the ExpertParallel, keyed by row_of_slot, as the
    all_to_all path does; calls outside the limits go to the functions below.
  Future plan: write it on an A2/A3 host, run `python -m deepinfer_conformance.multirank --backend
    ascend --ep N` there (the exact routing cases), and document any order deviation (within-expert
    order, combine summation order) in npu_ops.DEVIATIONS before enabling it by default.
"""

from __future__ import annotations

import dataclasses

from deepinfer.distributed.expert_parallel import EP_PRIORITY, expert_parallel_kernels  # noqa: F401
from deepinfer_ascend.kernels import moe as local

# Batch-invariant: the local kernels are (exact row copies; combine's fixed k order per token), and
# all_to_all_single only moves rows, bit for bit, adding nothing: a token's combined output is its
# K expert rows summed in the order k = 0..K-1 whatever the other ranks' batches hold.
REGISTRATIONS = [
    dataclasses.replace(r, batch_invariant=True)
    for r in expert_parallel_kernels(local.dispatch, local.combine, library="HCCL", local_note="Triton (ascend)")
]
dispatch, combine = (r.fn for r in REGISTRATIONS)
