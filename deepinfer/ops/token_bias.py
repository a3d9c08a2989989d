"""Per-token logit bias, and bans conditioned on the tokens just generated: what logit_bias,
bad_words, min_tokens and allowed_token_ids come down to.

A bias entry names a row, a token and a value (a finite bias, or -inf: banned) and, optionally, the
tokens that must precede it: a bad word of n tokens bans its last token only right after its first
n - 1 (vLLM's rule). The engine lists the entries once per request (a logit_bias, the bad words)
and adds the entries a step needs (min_tokens bans the stop tokens until enough were generated);
the matching of the preceding tokens runs on the device, against each row's last generated tokens.
"""

from __future__ import annotations

import torch

from deepinfer.registry import ALLCLOSE, op


def token_bias_kernel_args(logits, rows, tokens, values, prefixes, recent_tokens) -> list | None:
    """The kernels' tensor arguments (rows, tokens, values, prefixes, recent tokens: int64 / float32,
    contiguous) after the checks; None when there is no entry. Both backends' launchers start here."""
    check_token_bias_inputs(logits, rows, tokens, values, prefixes, recent_tokens)
    if rows.shape[0] == 0:
        return None
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"apply_token_bias runs on float32 logits with unit-stride rows, got {logits.dtype} with strides {logits.stride()}")
    pairs = ((rows, torch.int64), (tokens, torch.int64), (values, torch.float32), (prefixes, torch.int64), (recent_tokens, torch.int64))
    return [t.to(dtype).contiguous() for t, dtype in pairs]


def check_token_bias_inputs(logits, rows, tokens, values, prefixes, recent_tokens) -> None:
    """One-line ValueErrors for shapes that do not fit together (every backend calls this)."""
    batch, _ = logits.shape
    n = rows.shape[0]
    if tuple(tokens.shape) != (n,) or tuple(values.shape) != (n,) or rows.dim() != 1:
        raise ValueError(f"rows, tokens and values must be [N] alike, got {tuple(rows.shape)}, {tuple(tokens.shape)}, {tuple(values.shape)}")
    width = recent_tokens.shape[1] if recent_tokens.dim() == 2 else -1
    if recent_tokens.dim() != 2 or recent_tokens.shape[0] != batch:
        raise ValueError(f"recent_tokens has shape {tuple(recent_tokens.shape)}, expected [{batch}, P] for logits {tuple(logits.shape)}")
    if tuple(prefixes.shape) != (n, width):
        raise ValueError(f"prefixes has shape {tuple(prefixes.shape)}, expected ({n}, {width}): one prefix of P tokens per entry")


@op(family="sampling", outputs=("logits",), compare=ALLCLOSE, golden_precision="native", in_place="logits")
def apply_token_bias(
    logits: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    values: torch.Tensor,
    prefixes: torch.Tensor,
    recent_tokens: torch.Tensor,
) -> torch.Tensor:
    """Add biases and bans, in place. logits: [B, V] float32 (modified and returned). N entries:
    rows [N] int64 (in [0, B)), tokens [N] int64 (in [0, V)), values [N] float32 (finite, or -inf:
    banned), prefixes [N, P] int64: the tokens that must precede the entry's token, oldest first,
    right-aligned, -1 = any (P may be 0). recent_tokens: [B, P] int64, each row's last P generated
    tokens, oldest first, -1 where fewer were generated (a -1 matches only a -1 prefix).

    An entry applies when prefixes[n, j] < 0 or prefixes[n, j] == recent_tokens[rows[n], j] for
    every j. Applying finite values are added (float32, one addition: at most one finite entry per
    (row, token) may apply, the caller's promise); a token with an applying -inf entry becomes -inf
    whatever else applies to it. Entries that do not apply change nothing.
    """
    check_token_bias_inputs(logits, rows, tokens, values, prefixes, recent_tokens)
    if rows.numel() == 0:
        return logits
    rows, tokens = rows.long(), tokens.long()
    applies = ((prefixes < 0) | (prefixes == recent_tokens.long()[rows])).all(dim=1)
    banned = applies & (values == float("-inf"))
    added = torch.where(applies & ~banned, values.float(), 0.0)
    # The non-applying entries add +0.0, which leaves every value but -0.0 as it is.
    logits.index_put_((rows, tokens), added.to(logits.dtype), accumulate=True)
    hits = torch.zeros_like(logits, dtype=torch.int32).index_put_((rows, tokens), banned.to(torch.int32), accumulate=True)
    return logits.masked_fill_(hits > 0, float("-inf"))
