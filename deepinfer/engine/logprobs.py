"""Logprobs and prompt logprobs: `gather_logprobs` over the rows of a step that ask for them, and
the results' way to the requests.

The log-probabilities are the model's raw distribution, log_softmax of the float32 logits before
any processing (logits_processing) and before temperature: vLLM's default (raw_logprobs); with
logprobs_mode "processed_logprobs" those of the processed rows over temperature. A step's
results stay device tensors until the step's tokens are read (with overlap scheduling a later step
is queued before then: their copies to the host are queued with the tokens', never waited for on
their own); then each row becomes a TokenLogprobs record in its request, and `make_output` turns
records into vLLM's {token id: Logprob} dicts, decoding the tokens only then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.engine.outputs import Logprob, PositionLogprobs

# (chosen token, its logprob, its rank, top ids, top logprobs) of one position
TokenLogprobs = tuple[int, float, int, list[int], list[float]]


@dataclass
class LogprobRows:
    """gather_logprobs' results for some rows of a step: on the device, or on the host after `to_host`."""

    owners: list[Any]  # per row, what the caller files the result under (a sampler's index; a (sequence, position))
    num_top: list[int]  # per row, the top tokens its request asked for
    token_ids: torch.Tensor  # [R] int64
    results: tuple[torch.Tensor, ...]  # token_logprobs, token_ranks, top_ids, top_logprobs

    @classmethod
    def gather(cls, ops, logits: torch.Tensor, token_ids: torch.Tensor, owners: list[Any], num_top: list[int]) -> "LogprobRows":
        """gather_logprobs over the rows of `logits` [R, V] (float32, unprocessed) for `token_ids` [R]."""
        results = ops.gather_logprobs(logits=logits, token_ids=token_ids, num_top=max(num_top))
        return cls(owners, num_top, token_ids, tuple(results))

    def to_host(self, pinned: bool = False) -> "LogprobRows":
        """The same rows with host copies of the tensors, queued without waiting (pinned buffers:
        the copies overlap the device; valid once the step's tokens have been waited for)."""

        def copy(t: torch.Tensor) -> torch.Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
            return host.copy_(t, non_blocking=pinned)

        return LogprobRows(self.owners, self.num_top, copy(self.token_ids), tuple(copy(t) for t in self.results))

    def records(self) -> list[tuple[Any, TokenLogprobs]]:
        """(owner, record) per row, from host tensors."""
        token_lp, ranks, top_ids, top_lp = (t.tolist() for t in self.results)
        ids = self.token_ids.tolist()
        return [
            (owner, (ids[r], token_lp[r], ranks[r], top_ids[r][:k], top_lp[r][:k]))
            for r, (owner, k) in enumerate(zip(self.owners, self.num_top))
        ]


def position_logprobs(record: TokenLogprobs | None, tokenizer) -> PositionLogprobs | None:
    """A record as vLLM's dict: the chosen token first, then the top tokens (rank 1, 2, ...); a
    chosen token among the top ones keeps its place and takes the top entry."""
    if record is None:
        return None
    token, logprob, rank, top_ids, top_logprobs = record

    def text(token_id: int) -> str | None:
        return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else None

    out = {token: Logprob(logprob, rank, text(token))}
    for i, (top_id, top_logprob) in enumerate(zip(top_ids, top_logprobs), start=1):
        out[top_id] = Logprob(top_logprob, i, out[top_id].decoded_token if top_id in out else text(top_id))
    return out
