"""Speculative verification: which drafted tokens a request keeps, and the token that follows them.

Drafts are the draft model's argmax (MTP drafts greedily, as vLLM and SGLang do), so the draft
distribution at each position is a point mass q = delta_d. The standard speculative-sampling rule
(accept d with probability min(1, p(d) / q(d)) = p(d); on rejection, sample from
norm(max(p - q, 0)), which is p without d; after k accepted drafts, sample the bonus token from the
next position's p) is realised here by coupling it to `sample`'s stateless noise: each verified
position draws the token `sample` would draw there (same seed, same position, same Gumbel noise),
the draft is accepted iff that token equals it, and the first token that differs is the
correction. P(accept) = P(sampled == d) = p(d), and conditioned on a rejection the sampled token
follows p without d: the rule's distribution exactly. The coupling also makes a speculative run's
tokens, for a given seed, the tokens the same request draws without speculation (as far as the
target's logits agree bit for bit), greedy and sampled alike.
"""

from __future__ import annotations

import torch

from deepinfer.ops.sampling import sample
from deepinfer.registry import EXACT, op


@op(family="sampling", outputs=("tokens",), compare=EXACT, golden_precision="native")
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
    """Verify B requests' drafts in one call. logits: [T, V] float32, the target's logits at every
    verified position; request b owns rows cu_rows[b]:cu_rows[b+1] (cu_rows: [B+1] int32, from 0 to
    T, at least one row each): k_b >= 0 rows whose positions hold its drafts, then the bonus row.
    draft_tokens: [T] int64, draft_tokens[r] the token drafted at row r's position (the bonus row's
    value is ignored: -1 by convention). temperature, top_k, top_p, min_p, seeds: [B], per request,
    as `sample` takes them; positions: [B] int64, the position of the token row cu_rows[b] samples
    (row cu_rows[b] + i samples position positions[b] + i).

    Row r of request b samples s_r = sample(logits[r], b's parameters, seeds[b], positions[b] + i)
    (greedy rows: the argmax). The request keeps rows i = 0..j, j the first row with s_r !=
    draft_tokens[r], or its bonus row if every draft matches; tokens[r] = s_r there and -1 on the
    rows after j. Returns tokens: [T] int64. A request's tokens depend only on its own rows.
    """
    rows, _ = logits.shape
    counts = (cu_rows[1:] - cu_rows[:-1]).long()
    if counts.numel() and bool((counts < 1).any()):
        raise ValueError(f"every request needs at least one row (its bonus row), got rows per request {counts.tolist()}")
    owner, index, per_row = rows_of_requests(cu_rows, rows, temperature, top_k, top_p, min_p, seeds, positions)
    sampled = sample(logits, **per_row)
    is_bonus = index == counts[owner] - 1
    stops = (sampled != draft_tokens.long()) | is_bonus
    first_stop = torch.full_like(counts, rows).scatter_reduce(0, owner, torch.where(stops, index, rows), reduce="amin")
    return torch.where(index <= first_stop[owner], sampled, -1)


def rows_of_requests(cu_rows, rows: int, temperature, top_k, top_p, min_p, seeds, positions):
    """(owner, index, per_row): each row's request and its index in it ([rows] int64), and `sample`'s
    per-row arguments (the request's parameters and seed, position = the request's + index). Device
    operations only, no host synchronisation (every backend's kernel starts from it)."""
    starts = cu_rows[:-1].long()
    owner = torch.repeat_interleave(torch.arange(starts.numel(), device=cu_rows.device), cu_rows[1:].long() - starts, output_size=rows)
    index = torch.arange(rows, device=cu_rows.device) - starts[owner]
    per_row = dict(temperature=temperature[owner], top_k=top_k[owner], top_p=top_p[owner], min_p=min_p[owner], seeds=seeds[owner],
                   positions=positions.long()[owner] + index)  # fmt: skip
    return owner, index, per_row

