"""Ascend Triton kernel: `rejection_sample` (speculative-decoding verification on top of `sample`).

No host synchronisation anywhere (decode steps may be captured in graphs):

expand      each request's parameters (temperature, top_k, top_p, min_p, seed) to its rows and the
            row's position (positions[b] + the row's index within the request), by torch gathers on
            the device; the row -> request map is `repeat_interleave(arange(B), rows per request,
            output_size=T)`, its size from logits' shape, never from a look at the counts.
sample      this backend's own `sample` kernel on all T rows at once: row r draws exactly the token
            `sample` draws for (logits[r], its request's parameters, seed, position).
accept      Grid: `vector_grid(B)` programs, each looping over its requests (one per iteration).
            The request's draft rows are scanned for the first whose sampled token differs from its
            draft (the bonus row, the request's last, if none does); then its rows get the sampled
            tokens up to and including that row and -1 after it. Tokens are int64; as in `sample`
            (seeds, positions), the kernel sees them as int32 (low, high) word pairs, so no int64
            vector arithmetic: a flat, contiguous tile of 2 * BLOCK words (BLOCK rows, 128 bytes), a
            row differs iff one of its words does, and -1 is -1 in both words. Offsets are int32.

The op's precondition (every request has at least one row, cu_rows from 0 to T) is not checked: a
check would read the counts on the host. Rows outside every request are left unwritten.

Batch-invariant: a request's tokens depend only on its own rows. The expansion gathers (no
arithmetic on values); `sample` is batch-invariant (the small-batch chunked path gives a row the
row path's token bit for bit: exact fixed-point sums, exact threshold searches, noise hashed from
the row's own seed and position); the accept iteration for request b reads and writes only rows
cu_rows[b]:cu_rows[b+1], integer comparisons only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.rejection_sampling import rows_of_requests
from deepinfer_ascend.kernels import sampling as _sampling
from deepinfer_ascend.kernels.common import Registration, launch_options, vector_grid

_ACCEPT_BLOCK = 16  # rows per step: 32 int32 words, 128 bytes (MTP verifies a few drafts per request)


@triton.jit
def _accept_kernel(sampled_ptr, draft_ptr, cu_ptr, out_ptr, B, BLOCK: tl.constexpr):
    """Tokens as int32 word pairs: row r's words at 2r (low) and 2r + 1 (high)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, 2 * BLOCK)
    for req in range(pid, B, nprog):
        start = tl.load(cu_ptr + req)
        end = tl.load(cu_ptr + req + 1)
        bonus = end - 1
        stop = bonus  # the last row kept: the first draft row whose token differs, else the bonus row
        for w0 in range(2 * start, 2 * bonus, 2 * BLOCK):
            w = w0 + lanes
            ok = w < 2 * bonus
            s = tl.load(sampled_ptr + w, mask=ok, other=0)
            d = tl.load(draft_ptr + w, mask=ok, other=0)
            stop = tl.minimum(stop, tl.min(tl.where(ok & (s != d), w >> 1, bonus), axis=0))
        for w0 in range(2 * start, 2 * end, 2 * BLOCK):
            w = w0 + lanes
            ok = w < 2 * end
            s = tl.load(sampled_ptr + w, mask=ok, other=0)
            tl.store(out_ptr + w, tl.where((w >> 1) <= stop, s, -1), mask=ok)


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
    if 2 * rows >= 2**31:
        raise ValueError(f"rejection_sample (ascend Triton): {rows} rows exceed int32 offsets")
    cu = cu_rows.to(torch.int32).contiguous()
    _, _, per_row = rows_of_requests(cu, rows, temperature, top_k, top_p, min_p, seeds, positions)
    sampled = _sampling.sample(logits, **per_row)
    drafts = draft_tokens.to(torch.int64).contiguous()
    _accept_kernel[(vector_grid(requests),)](
        sampled.contiguous().view(torch.int32), drafts.view(torch.int32), cu, out.view(torch.int32), requests,
        BLOCK=_ACCEPT_BLOCK, **launch_options(),
    )
    return out


REGISTRATIONS = [
    # Invariant as it is: gathers, then `sample` (each row's token from its own logits, parameters, seed and
    # position), then one loop iteration per request that reads and writes only that request's rows.
    Registration(
        op="rejection_sample",
        fn=rejection_sample,
        batch_invariant=True,
        note="Triton (ascend): the backend's sample on every row (parameters expanded on device), one accept iteration per request",
    ),
]
