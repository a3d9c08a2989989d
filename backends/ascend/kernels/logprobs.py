"""Ascend Triton kernel: `gather_logprobs` (log-probabilities of chosen tokens, their ranks, each row's top tokens).

Grid: `vector_grid(R)` programs, each looping over its rows (one row per iteration), BLOCK logits
at a time with the cuda kernel's row passes (deepinfer.triton_logits): one pass for the
log-sum-exp (running maximum and rescaled sum per lane, float32) and the chosen token's rank, then
one pass per top token (the next logit after the last one found, descending logit, ascending id
among equals). No sort, no scratch memory, int32 offsets (fewer than 2^31 logits per call); ranks
and ids compare logits, so they are exact.

Buffer budget: about 8 live 4-byte values per lane (logits, running maximum, sum, count, best
value and id, the masks), so BLOCK is the largest power of two within half the unified buffer at
32 bytes per element, at most 2048.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.logprobs import logprobs_kernel_args
from deepinfer.triton_common import next_power_of_2
from deepinfer.triton_logits import row_logsumexp_and_rank, row_next_top
from deepinfer_ascend.kernels.common import Registration, launch_options, tile_elems, vector_grid

_BYTES_PER_ELEM = 32
_MAX_BLOCK = 2048


@triton.jit
def _logprobs_kernel(
    logits_ptr, stride_l, ids_ptr, token_lp_ptr, rank_ptr, top_ids_ptr, top_lp_ptr, R, V, NUM_TOP,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for row in range(pid, R, nprog):
        lp = logits_ptr + row * stride_l  # int32: the wrapper refuses 2^31 logits or more
        chosen = tl.load(lp + tl.load(ids_ptr + row))
        lse, rank = row_logsumexp_and_rank(lp, V, chosen, BLOCK)
        tl.store(token_lp_ptr + row, chosen - lse)
        tl.store(rank_ptr + row, rank.to(tl.int64))
        x = lse * 0.0 + float("inf")
        idx = rank * 0 - 1
        for i in range(0, NUM_TOP):
            x, idx = row_next_top(lp, V, x, idx, BLOCK)
            tl.store(top_ids_ptr + row * NUM_TOP + i, idx.to(tl.int64))
            tl.store(top_lp_ptr + row * NUM_TOP + i, x - lse)


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, ids, (token_lp, ranks, top_ids, top_lp) = logprobs_kernel_args(logits, token_ids, num_top)
    rows, vocab = x.shape
    if rows == 0:
        return token_lp, ranks, top_ids, top_lp
    if x.shape[0] * x.stride(0) >= 2**31:
        raise ValueError(f"gather_logprobs on ascend takes fewer than 2^31 logits per call (int32 offsets), got {tuple(x.shape)}")
    block = max(32, min(_MAX_BLOCK, tile_elems(_BYTES_PER_ELEM), next_power_of_2(vocab)))
    _logprobs_kernel[(vector_grid(rows),)](
        x, x.stride(0), ids, token_lp, ranks, top_ids, top_lp, rows, vocab, num_top,
        BLOCK=block, **launch_options(),
    )
    return token_lp, ranks, top_ids, top_lp


REGISTRATIONS = [
    Registration(op="gather_logprobs", fn=gather_logprobs, batch_invariant=True,
                 note="Triton (ascend): row per program iteration, log-sum-exp and rank in one pass, a pass per top token"),
]  # fmt: skip
