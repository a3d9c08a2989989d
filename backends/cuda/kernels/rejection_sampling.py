"""Triton kernel: `rejection_sample` (speculative-decoding verification on top of `sample`).

Three steps, no host synchronisation anywhere (decode steps may be captured in CUDA graphs):

  Expand: each request's parameters (temperature, top_k, top_p, min_p, seed) to its rows and the
    row's position (positions[b] + the row's index within the request), by torch gathers on the
    device: the row -> request map is `repeat_interleave(arange(B), rows per request,
    output_size=T)`, so its size comes from logits' shape, never from a look at the counts.
  Sample: this backend's own `sample` kernels on all T rows at once: row r draws exactly the token
    `sample` draws for (logits[r], its request's parameters, seed, position).
  Accept (one program per request): scan the request's draft rows for the first one whose sampled
    token differs from its draft (the bonus row, the request's last, if none does), then write the
    sampled tokens up to and including that row and -1 after it. The rows are read BLOCK at a time,
    so any number of drafts per request is served by one launch.

The op's precondition (every request has at least one row, cu_rows from 0 to T) is not checked: a
check would read the counts on the host. Rows outside every request are left unwritten.

Batch-invariant: a request's tokens depend only on its own rows. The expansion gathers (no
arithmetic on values); `sample` is batch-invariant (each row's token depends only on that row's
logits and parameters: chunking from V and the device only, noise hashed from the row's own seed
and position); the accept program of request b reads and writes only rows cu_rows[b]:cu_rows[b+1],
with integer comparisons only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.rejection_sampling import rows_of_requests
from deepinfer_cuda.kernels import sampling as _sampling
from deepinfer_cuda.kernels.common import Registration, pdl_launch, pdl_prologue

_ACCEPT_BLOCK = 16  # rows of a request compared per step (MTP verifies a few drafts per request)


@triton.jit
def _accept_kernel(sampled_ptr, draft_ptr, cu_ptr, out_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program b: request b's rows cu[b]:cu[b+1]; keep up to the first mismatch or the bonus row."""
    pdl_prologue(PDL)
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    bonus = end - 1
    stop = bonus  # the last row kept: the first draft row whose token differs, else the bonus row
    for r0 in range(start, bonus, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        ok = r < bonus
        s = tl.load(sampled_ptr + r, mask=ok, other=0)
        d = tl.load(draft_ptr + r, mask=ok, other=0)
        stop = tl.minimum(stop, tl.min(tl.where(ok & (s != d), r, bonus), axis=0))
    for r0 in range(start, end, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        ok = r < end
        s = tl.load(sampled_ptr + r, mask=ok, other=0)
        tl.store(out_ptr + r, tl.where(r <= stop, s, -1), mask=ok)


def rejection_sample(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_rows: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    rows = logits.shape[0]
    requests = cu_rows.shape[0] - 1
    device = logits.device
    out = torch.empty(rows, dtype=torch.int64, device=device)
    if rows == 0 or requests <= 0:
        return out
    cu = cu_rows if cu_rows.dtype == torch.int32 and cu_rows.is_contiguous() else cu_rows.to(torch.int32).contiguous()
    _, _, per_row = rows_of_requests(cu, rows, temperature, top_k, top_p, min_p, seeds, positions)
    sampled = _sampling.sample(logits, **per_row)
    drafts = draft_tokens if draft_tokens.dtype == torch.int64 and draft_tokens.is_contiguous() else draft_tokens.to(torch.int64).contiguous()
    _accept_kernel[(requests,)](sampled, drafts, cu, out, BLOCK=_ACCEPT_BLOCK, num_warps=1, **pdl_launch(sampled.device))
    return out


REGISTRATIONS = [
    # Batch-invariant as it is: gathers, then `sample` (each row's token from its own logits, parameters,
    # seed and position), then one program per request that reads and writes only that request's rows.
    Registration(op="rejection_sample", fn=rejection_sample, batch_invariant=True,
                 note="Triton: the backend's sample on every row (parameters expanded on device), one accept program per request"),
]  # fmt: skip
