"""DeepSeek-V4.1's Engram: hashed n-gram memory rows, and their gated addition to the residual streams.

Before its attention site, an Engram layer looks up, for every token, one row per (n-gram order n in
2..max, hash head) of a static table, keyed by the token's last n compressed token ids; a projection
of those rows gives a key per residual stream and one value; each stream adds the value through a
gate of its key's normalised agreement with the stream (DeepSeek's released `inference/engram.py`,
restated from NeMo Automodel 0.7.0's `deepseek_v41/engram.py`).
"""

from __future__ import annotations

import torch

from deepinfer.ops.sparse_attention import V41
from deepinfer.registry import ALLCLOSE, EXACT, op


@op(family="misc", outputs=("rows",), compare=EXACT, golden_precision="native", model_types=V41)
def engram_hash(ngram_ids: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The table rows of each token's n-grams.

    ngram_ids: [T, M] int64, column j the compressed id of the token j positions back (the pad's
    compressed id where that is before the sequence or blocked); multipliers: [M] int64 (odd);
    primes, offsets: [M - 1, H] int64, the bucket count and first row of each (order n = 2..M, head).
    With p_j = ngram_ids[:, j] * multipliers[j] and x_n = p_0 ^ p_1 ^ .. ^ p_{n-1} (int64, no overflow
    for the release's bounds), row(n, h) = x_n mod primes[n-2, h] + offsets[n-2, h].
    Returns [T, (M - 1) * H] int64, ordered n-major then head."""
    if ngram_ids.dim() != 2 or multipliers.shape != (ngram_ids.shape[1],) or primes.shape != offsets.shape or primes.shape[0] != ngram_ids.shape[1] - 1:
        raise ValueError(
            f"engram_hash wants ngram_ids [T, M], multipliers [M], primes and offsets [M-1, H]; got {tuple(ngram_ids.shape)}, "
            f"{tuple(multipliers.shape)}, {tuple(primes.shape)}, {tuple(offsets.shape)}"
        )
    products = ngram_ids.long() * multipliers.long()
    rolling = products[:, 0]
    rows = []
    for n in range(1, ngram_ids.shape[1]):
        rolling = torch.bitwise_xor(rolling, products[:, n])
        rows.append(rolling[:, None] % primes[n - 1].long() + offsets[n - 1].long())
    return torch.cat(rows, dim=-1) if rows else ngram_ids.new_zeros(ngram_ids.shape[0], 0)


def check_engram_gate_args(streams, keys, value, q_weight, k_weight) -> None:
    """`engram_gate_add`'s shapes: every backend's check."""
    if streams.dim() != 3 or keys.shape != streams.shape or value.shape != (streams.shape[0], streams.shape[2]):
        got = f"{tuple(streams.shape)}, {tuple(keys.shape)}, {tuple(value.shape)}"
        raise ValueError(f"engram_gate_add wants streams and keys [T, N, D], value [T, D]; got {got}")
    if q_weight.shape != streams.shape[1:] or k_weight.shape != streams.shape[1:]:
        raise ValueError(f"q_weight and k_weight must be [N, D] = {tuple(streams.shape[1:])}, got {tuple(q_weight.shape)}, {tuple(k_weight.shape)}")


@op(family="misc", outputs=("out",), compare=ALLCLOSE, reduction_length=lambda kw: kw["streams"].shape[2], model_types=V41)
def engram_gate_add(
    streams: torch.Tensor,
    keys: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    *,
    eps: float,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The streams after Engram's gated addition.

    streams: [T, N, D]; keys: [T, N, D] (one per stream); value: [T, D]; q_weight, k_weight: [N, D].
    Per token and stream s, in float32:
        dot = sum(X_s * q_weight[s] * k_weight[s] * K_s) * rsqrt(mean(X_s^2) + eps) * rsqrt(mean(K_s^2) + eps) / sqrt(D)
        g   = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))
        X_s + g * V
    token_mask: [T] bool, optional: False rows (image, padding) get g = 0. Returns [T, N, D] in streams'
    dtype (float64 for float64 streams)."""
    check_engram_gate_args(streams, keys, value, q_weight, k_weight)
    acc = torch.float64 if streams.dtype == torch.float64 else torch.float32
    hidden, key = streams.to(acc), keys.to(acc)
    weights = q_weight.to(acc) * k_weight.to(acc)
    rstd = torch.rsqrt(hidden.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (hidden * weights * key).sum(-1) * rstd * streams.shape[2] ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp(min=1e-6).sqrt(), dot))
    if token_mask is not None:
        gate = gate.masked_fill(~token_mask.bool()[:, None], 0)
    return (hidden + gate[..., None] * value.to(acc)[:, None, :]).to(streams.dtype)
