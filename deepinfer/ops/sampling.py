"""Sampling: one token per row from logits, reproducible on every backend and in every batch.

Randomness is a stateless hash of (seed, position, vocab index), never a generator's state: the
same logits, seed and position give the same token whatever else is in the batch and whichever
backend runs it. The hash uses only 32-bit integer multiply, xor and shift, which every backend
computes exactly; `sampling_uniform` is its definition.
"""

from __future__ import annotations

import torch

from deepinfer.registry import EXACT, op


def sampling_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u[b, v] in (0, 1), float32, from (seeds[b], positions[b], v). All arithmetic is mod 2^32:

        mix(x) = x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15; x *= 0xD35A2D97; x ^= x >> 15
        row    = mix(mix(mix(seed_lo + 0x9E3779B9) ^ seed_hi) ^ position_lo)
        h      = mix(row ^ v)
        u      = ((h >> 9) + 0.5) * 2^-23          (exact in float32)
    seed_lo / seed_hi are the low / high 32 bits of the int64 seed, position_lo the low 32 bits.
    """
    raise NotImplementedError


@op(family="sampling", outputs=("tokens",), compare=EXACT, golden_precision="native")
def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """One token per row. logits: [B, V] float32; per row: temperature [B] float32, top_k [B] int32
    (<= 0 or >= V: off), top_p [B] float32 (1.0: off), min_p [B] float32 (0.0: off), seeds [B]
    int64, positions [B] int64 (the position of the token being sampled).

    temperature == 0: greedy, argmax of logits (lowest index on ties); the filters do not apply.
    Otherwise, in float32: z = logits / temperature; p = softmax(z).
      keep_k: logits >= the top_k-th largest logit (ties at the threshold are kept);
      keep_p: with q = p renormalised over keep_k and sorted descending, the smallest prefix whose
              cumulative sum reaches top_p; keep q >= the last value of that prefix;
      keep_m: p >= min_p * max(p).
    token = argmax over kept v of z[v] + g[v] (lowest index on ties), with Gumbel noise
    g = -log(-log(u)), u = sampling_uniform(seeds, positions, V).
    Returns [B] int64.
    """
    raise NotImplementedError


@op(family="sampling", outputs=("logits",), compare=EXACT, golden_precision="native", in_place="logits")
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured output: forbid tokens. logits: [B, V] float (modified in place and returned);
    bitmask: [B, ceil(V/32)] int32, bit (v % 32) of word v // 32 set = token v allowed (xgrammar's
    layout). Forbidden logits become -inf.
    """
    raise NotImplementedError
