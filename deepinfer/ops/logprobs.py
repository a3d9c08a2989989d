"""Log-probabilities of chosen tokens and of each row's most likely tokens (vLLM's logprobs and
prompt_logprobs): the log-softmax of the model's logits, a token's rank, the top tokens.

Ranks and the top tokens are defined on the logits themselves, not on rounded log-probabilities,
so they are the same integers on every backend: only the log-probability values carry rounding.
"""

from __future__ import annotations

import math

import torch

from deepinfer.registry import ALLCLOSE, EXACT, op

MAX_TOP = 64  # the most top tokens one call returns (kernels hold them in registers)


def check_logprobs_inputs(logits, token_ids, num_top) -> None:
    """One-line ValueErrors for inputs that do not fit together (every backend calls this)."""
    if logits.dim() != 2 or tuple(token_ids.shape) != (logits.shape[0],):
        raise ValueError(f"logits must be [R, V] and token_ids [R], got {tuple(logits.shape)} and {tuple(token_ids.shape)}")
    if not isinstance(num_top, int) or isinstance(num_top, bool) or not 0 <= num_top <= min(MAX_TOP, logits.shape[1]):
        raise ValueError(f"num_top must be an integer in [0, {min(MAX_TOP, logits.shape[1])}], got {num_top!r}")


def logprobs_kernel_args(logits, token_ids, num_top):
    """What both backends' kernels start from, after the checks: the logits as float32 with unit-stride
    rows, the token ids as int64, and the four outputs (token logprobs, ranks, top ids, top logprobs),
    allocated empty on the logits' device."""
    check_logprobs_inputs(logits, token_ids, num_top)
    rows, device = logits.shape[0], logits.device
    outputs = (
        torch.empty(rows, dtype=torch.float32, device=device),
        torch.empty(rows, dtype=torch.int64, device=device),
        torch.empty(rows, num_top, dtype=torch.int64, device=device),
        torch.empty(rows, num_top, dtype=torch.float32, device=device),
    )
    x = logits if logits.dtype == torch.float32 and logits.stride(-1) == 1 else logits.to(torch.float32).contiguous()
    return x, token_ids.to(torch.int64).contiguous(), outputs


def _summation_depth(kwargs) -> int:
    """The log-sum-exp's rounding grows with its sum of V terms: like the depth of a summation tree,
    log2(V), for a pairwise sum, but like sqrt(V) for the lane-by-lane float32 sums of a CPU's
    vectorised reduction (torch's on an AMD EPYC host: 2.4e-5 off at V = 129280, where log2(V)
    alone allowed 2.1e-5); sqrt(V) / 8 for 8 lanes."""
    v = max(2, kwargs["logits"].shape[-1])
    return max(int(math.log2(v)) + 1, math.ceil(math.sqrt(v) / 8))


@op(
    family="sampling",
    outputs=("token_logprobs", "token_ranks", "top_ids", "top_logprobs"),
    compare={"token_logprobs": ALLCLOSE, "token_ranks": EXACT, "top_ids": EXACT, "top_logprobs": ALLCLOSE},
    reduction_length=_summation_depth,
)
def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row r of logits [R, V] (float32; at least one finite logit per row), with
    lp = log_softmax(logits[r]):
      token_logprobs [R] float32: lp[token_ids[r]] (token_ids: [R] int64, in [0, V));
      token_ranks [R] int64: the number of v with logits[r, v] >= logits[r, token_ids[r]] (1: the
        most likely token; tied tokens share the larger rank, as vLLM counts);
      top_ids [R, num_top] int64: the num_top largest logits' ids, by descending logit, the lowest id
        first among equal logits;
      top_logprobs [R, num_top] float32: lp at top_ids.
    num_top: an integer in [0, min(MAX_TOP, V)]. -inf logits have log-probability -inf.
    """
    check_logprobs_inputs(logits, token_ids, num_top)
    ids = token_ids.long()[:, None]
    lp = logits.log_softmax(dim=-1)
    chosen = logits.gather(-1, ids)
    ranks = (logits >= chosen).to(torch.int64).sum(dim=-1)
    top_ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :num_top]
    return lp.gather(-1, ids).squeeze(-1), ranks, top_ids, lp.gather(-1, top_ids)
