"""Triton kernel: `gather_logprobs` (log-probabilities of chosen tokens, their ranks, each row's top tokens).

Grid (R,): one program per row, BLOCK logits at a time (deepinfer.triton_logits). One pass gives the
log-sum-exp (a running maximum and rescaled sum per lane, float32) and the chosen token's rank (the
count of logits >= its own); then one pass per top token, each finding the next logit after the
last one found in the op's order (descending logit, ascending id among equals): num_top + 1 reads
of the row, no sort, no scratch memory. Ranks and ids compare logits, so they are exact; the
log-probabilities carry the float32 log-sum-exp's rounding (tl.exp / tl.log: a few ulp).

Used on the steps that ask for logprobs (eager steps: the engine runs those outside device graphs),
and over prompt positions for prompt_logprobs: R can be a prompt's length.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer.ops.logprobs import logprobs_kernel_args
from deepinfer.triton_common import next_power_of_2
from deepinfer.triton_logits import row_logsumexp_and_rank, row_next_top
from deepinfer_cuda.kernels.common import Registration, pdl_launch, pdl_prologue
from deepinfer_cuda.tuning import config


@lru_cache(maxsize=None)
def _cfg(device: torch.device) -> dict:
    return config("gather_logprobs", "rows", device)


@triton.jit
def _logprobs_kernel(
    logits_ptr, stride_l, ids_ptr, token_lp_ptr, rank_ptr, top_ids_ptr, top_lp_ptr, V, NUM_TOP,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    lp = logits_ptr + row.to(tl.int64) * stride_l
    token = tl.load(ids_ptr + row)
    chosen = tl.load(lp + token)
    lse, rank = row_logsumexp_and_rank(lp, V, chosen, BLOCK)
    tl.store(token_lp_ptr + row, chosen - lse)
    tl.store(rank_ptr + row, rank.to(tl.int64))
    x = lse * 0.0 + float("inf")
    idx = rank * 0 - 1
    out = row.to(tl.int64) * NUM_TOP
    for i in range(0, NUM_TOP):
        x, idx = row_next_top(lp, V, x, idx, BLOCK)
        tl.store(top_ids_ptr + out + i, idx.to(tl.int64))
        tl.store(top_lp_ptr + out + i, x - lse)


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, ids, (token_lp, ranks, top_ids, top_lp) = logprobs_kernel_args(logits, token_ids, num_top)
    rows, vocab = x.shape
    if rows == 0:
        return token_lp, ranks, top_ids, top_lp
    cfg = _cfg(x.device)
    block = min(cfg["BLOCK"], next_power_of_2(vocab))
    _logprobs_kernel[(rows,)](
        x, x.stride(0), ids, token_lp, ranks, top_ids, top_lp, vocab, num_top,
        BLOCK=block, num_warps=cfg["num_warps"], **pdl_launch(x.device),
    )
    return token_lp, ranks, top_ids, top_lp


REGISTRATIONS = [
    Registration(op="gather_logprobs", fn=gather_logprobs, note="Triton (one program per row: log-sum-exp and rank in one pass, a pass per top token)",
                 batch_invariant=True),
]  # fmt: skip
