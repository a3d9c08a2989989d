"""Expert-parallel `dispatch` / `combine` for the cuda backend: tokens cross ranks by all_to_all_single.

The local work is the Triton kernels of `deepinfer_cuda.kernels.moe` (the counting-sort dispatch
that yields this rank's send layout, and the fixed-order combine); the rows travel between ranks
with torch.distributed's `all_to_all_single` over the ep_group's process group
(`deepinfer.distributed.ExpertParallel.exchange_dispatch` / `exchange_combine`): NCCL on GPUs, and
whatever library the group has otherwise (gloo on CPU tensors under TRITON_INTERPRET=1, which is
how CI checks this module on a machine without GPUs). The split sizes are exchanged once per
dispatch (one all_to_all of the per-expert counts, one host synchronisation to size the receive
buffer), as the op's contract says.

Built by `deepinfer.distributed.expert_parallel.expert_parallel_kernels`: registered with
`when=ctx.ep_size > 1` and priority EP_PRIORITY, above the local kernels (which
refuse a group of several ranks), so resolving the ops with ep_size > 1 picks these. With ep_group
None or a one-rank group they are the local kernels.

Within one host the registry prefers `moe_ep_symm` (rows stored straight into the peers'
symmetric-memory buffers; same rows, same order), unless the backend option ep_path is nccl
(deepinfer_cuda.options).
"""

from __future__ import annotations

from dataclasses import replace

from deepinfer.distributed.expert_parallel import EP_PRIORITY, expert_parallel_kernels  # noqa: F401
from deepinfer_cuda.kernels import moe as local

# Batch-invariant (deterministic mode may choose them): rows cross ranks as exact copies, and the
# combine is the local one on the source rank, each token's K rows summed in k order; which rank
# (or redundant copy) computed a row does not change it (the invariant grouped_gemm, identical
# copies). The symmetric-memory path (moe_ep_symm) is not marked: its owners' partials are summed
# per owner rank, and which rank holds a token's copy of a redundant expert follows its place in
# the batch, so the order of additions does; with ep_size > 1 deterministic mode takes this path.
REGISTRATIONS = [
    replace(r, batch_invariant=True) for r in expert_parallel_kernels(local.dispatch, local.combine, library="NCCL", local_note="Triton")
]
dispatch, combine = (r.fn for r in REGISTRATIONS)
