"""V4.1's Engram layers: hashed n-gram memory added to the residual streams before the attention site.

`EngramHashing` holds the hash constants (as DeepSeek's released code derives them: per-layer odd multipliers
from numpy's generator seeded 10007 x layer id, bucket primes from one walk over the primes above
engram_vocab_size, row offsets their running sums) and the compressed token map (engram_tokens.py);
`V41Engram` is one layer's table, projection and gated update.
"""

from __future__ import annotations

import math

import torch

from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.decode_plan import V41DecodePlan
from deepinfer.model.deepseek_v41.spans import Span


def _is_prime(n: int) -> bool:
    return n == 2 or (n > 2 and n % 2 == 1 and all(n % d for d in range(3, math.isqrt(n) + 1, 2)))


def hash_constants(config: V41Config, compressed_vocab: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per Engram layer: (multipliers [M] int64, primes [M-1, H] int64, offsets [M-1, H] int64), M = max n-gram size."""
    import numpy as np

    c = config
    used: set[int] = set()
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    out = []
    for layer in c.engram_layer_ids:
        primes = []
        for _ in range(c.engram_max_ngram_size - 1):
            p = c.engram_vocab_size - 1  # each order's walk restarts here, skipping primes taken before
            for _ in range(c.engram_n_heads):
                p += 1
                while not _is_prime(p) or p in used:
                    p += 1
                used.add(p)
                primes.append(p)
        offsets = [0] + list(np.cumsum(primes[:-1]).tolist())
        multipliers = np.random.default_rng(10007 * layer).integers(0, bound, size=(c.engram_max_ngram_size,), dtype=np.int64) * 2 + 1
        shape = (c.engram_max_ngram_size - 1, c.engram_n_heads)
        out.append((torch.tensor(multipliers.tolist(), dtype=torch.int64), torch.tensor(primes).view(shape), torch.tensor(offsets).view(shape)))
    return out


class EngramHashing:
    """Each new token's table rows for every Engram layer, from its compressed id and its sequence's last ones."""

    def __init__(self, config: V41Config, token_map: torch.Tensor, compressed_vocab: int, device):
        self.config = config
        self.token_map = token_map.to(device)
        self.pad = int(token_map[config.engram_pad_token_id])
        self.constants = [tuple(t.to(device) for t in k) for k in hash_constants(config, compressed_vocab)]

    def __call__(self, ops, input_ids: torch.Tensor, spans: list[Span], history: torch.Tensor) -> list[torch.Tensor]:
        """[T, rows per token] int64 per Engram layer. history: [slots, R >= M-1] the compressed ids of each
        sequence's recent tokens, position p in row p % R (caches.py; rewritten here with the span's last ones)."""
        lookback = self.config.engram_max_ngram_size - 1
        ids = self.token_map[input_ids]
        ring_rows = history.shape[1]
        columns = []
        for span in spans:
            # this sequence's compressed ids, oldest first: its last lookback ids before the span (pad before
            # position 0), then the span's; a token's n-gram reads the n - 1 before it
            earlier = torch.arange(span.start - lookback, span.start, device=ids.device)
            before = torch.where(earlier >= 0, history[span.slot, earlier % ring_rows], self.pad)
            seq = torch.cat((before, ids[span.rows]))
            columns.append(torch.stack([seq[lookback - j : lookback - j + span.length] for j in range(lookback + 1)], dim=1))
            last = torch.arange(max(span.start - lookback, span.end - ring_rows), span.end, device=ids.device)
            history[span.slot, last % ring_rows] = seq[last - span.start + lookback]
        grams = torch.cat(columns)  # [T, M]: column j the id j tokens back
        return [ops.engram_hash(grams, m, p, o) for m, p, o in self.constants]


    def decode(self, ops, input_ids: torch.Tensor, plan: V41DecodePlan, history: torch.Tensor) -> list[torch.Tensor]:
        """A decode step's (decode_plan.py): [B, rows per token] per Engram layer, one token per sequence, its n-grams
        from the slot's last ids; the token's id then goes into its slot's history (padding rows: the scratch slot's)."""
        ids = self.token_map[input_ids]
        flat = history.view(-1)
        # torch glue: a gather of each token's last ids (pad before position 0), then an index_put of its own id
        before = torch.where(plan.engram_reads >= 0, flat[plan.engram_reads.clamp(min=0)], self.pad)  # [B, M - 1], oldest first
        grams = torch.cat((ids[:, None], before.flip(1)), dim=1)  # [B, M]: column j the id j tokens back
        flat[plan.engram_write] = ids
        return [ops.engram_hash(grams, m, p, o) for m, p, o in self.constants]


class V41Engram:
    def __init__(self, config: V41Config, weights, prefix: str):
        self.config = config
        self.table = weights.tensor(f"{prefix}engram.embed.weight")
        self.wkv = weights.linear(f"{prefix}engram.wkv")
        self.q_weight = weights.tensor(f"{prefix}engram.q_weight")
        self.k_weight = weights.tensor(f"{prefix}engram.k_weight")

    def __call__(self, ops, streams: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """streams [T, N, D] after adding the memory of each token's rows [T, R] (int64)."""
        tokens, n, hidden = streams.shape
        memory = self.table[rows].flatten(1).to(streams.dtype)  # a gather: the table lookup (torch glue, as the embedding's)
        projected = self.wkv(ops, memory)
        keys, value = projected[:, : n * hidden].view(tokens, n, hidden), projected[:, n * hidden :]
        return ops.engram_gate_add(streams, keys.contiguous(), value.contiguous(), self.q_weight, self.k_weight, eps=self.config.rms_norm_eps)
