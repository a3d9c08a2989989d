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
    seed_lo / seed_hi are the low / high 32 bits of the int64 seed (two's complement),
    position_lo the low 32 bits. seeds, positions: [B] int64; returns [B, vocab_size].
    """
    seeds, positions = seeds.long(), positions.long()
    seed_lo, seed_hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    row = _mix(_mix(_mix((seed_lo + 0x9E3779B9) & _MASK32) ^ seed_hi) ^ (positions & _MASK32))
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    h = _mix(row[:, None] ^ vocab)
    # h >> 9 < 2^23, so (h >> 9) + 0.5 and its product with 2^-23 are exact in float32.
    return ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23


# uint32 arithmetic emulated on int64 tensors holding values in [0, 2^32).
_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x * constant mod 2^32 without int64 overflow (x, constant < 2^32).

    A full 32x32-bit product needs 64 unsigned bits, past int64's range, and torch does not
    promise wrap-around on overflow. Split the constant: x * lo < 2^48, and of x * hi only the
    low 16 bits survive the shift by 16 modulo 2^32, so every intermediate stays below 2^49.
    """
    lo, hi = constant & 0xFFFF, constant >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x21F0AAAD)
    x = x ^ (x >> 15)
    x = _mul32(x, 0xD35A2D97)
    return x ^ (x >> 15)


@op(family="sampling", outputs=("tokens",), compare=EXACT, golden_precision="native")
def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    all_greedy: bool = False,
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
    kept = keep_k and keep_p and keep_m (the row's maximum always survives).
    token = argmax over kept v of z[v] + g[v] (lowest index on ties), with Gumbel noise
    g = -log(-log(u)), u = sampling_uniform(seeds, positions, V).
    Returns [B] int64. Every row depends only on its own inputs, never on the rest of the batch.
    all_greedy: every row is greedy, whatever `temperature` holds (the caller knows it on the host, from the
    requests): a backend runs only the greedy path, without reading the per-row parameters (an eager step of
    greedy requests then launches what torch.argmax would, not the filters' passes too).
    """
    logits = logits.float()
    greedy = temperature == 0
    # On the CPU a look at the values costs nothing (elsewhere it would synchronise): skip the
    # vocabulary sorts when no row needs them. Results are the same either way.
    on_cpu = logits.device.type == "cpu"
    if all_greedy or (on_cpu and bool(greedy.all())):
        return logits.argmax(dim=-1)
    # Greedy rows divide by 1 instead (their z is unused), so no row produces inf or nan.
    z = logits / torch.where(greedy, 1.0, temperature.float())[:, None]
    p = z.softmax(dim=-1)
    vocab = logits.shape[-1]
    everything = torch.ones_like(logits, dtype=torch.bool)
    top_k_off = on_cpu and bool(((top_k <= 0) | (top_k >= vocab) | greedy).all())
    top_p_off = on_cpu and bool(((top_p >= 1) | greedy).all())
    keep_k = everything if top_k_off else _keep_top_k(logits, top_k)
    keep_p = everything if top_p_off else _keep_top_p(p, keep_k, top_p)
    kept = keep_k & keep_p & _keep_min_p(p, min_p)
    noise = -torch.log(-torch.log(sampling_uniform(seeds, positions, logits.shape[-1])))
    perturbed = (z + noise).masked_fill(~kept, float("-inf"))
    # torch.argmax returns the first maximal index: ties go to the lowest vocab index.
    return torch.where(greedy, logits.argmax(dim=-1), perturbed.argmax(dim=-1))


def _keep_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """logits >= the row's top_k-th largest logit; top_k <= 0 or >= V keeps everything."""
    vocab = logits.shape[-1]
    descending = torch.sort(logits, dim=-1, descending=True).values
    kth_largest = descending.gather(-1, (top_k.long().clamp(1, vocab) - 1)[:, None])
    off = ((top_k <= 0) | (top_k >= vocab))[:, None]
    return off | (logits >= kth_largest)


def _keep_top_p(p: torch.Tensor, keep_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus of p renormalised over keep_k: q >= the last q of the shortest sorted prefix
    whose cumulative sum reaches top_p. top_p >= 1 keeps everything."""
    q = p * keep_k
    q = q / q.sum(dim=-1, keepdim=True)
    q_sorted = torch.sort(q, dim=-1, descending=True).values
    # The cumulative sum never decreases, so the prefix ends at the first entry reaching top_p;
    # if rounding keeps it below top_p to the end, the prefix is the whole row.
    below = (q_sorted.cumsum(dim=-1) < top_p.float()[:, None]).sum(dim=-1, keepdim=True)
    last_in_prefix = q_sorted.gather(-1, below.clamp(max=q.shape[-1] - 1))
    return (top_p >= 1)[:, None] | (q >= last_in_prefix)


def _keep_min_p(p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """p >= min_p * max(p); min_p = 0 keeps everything."""
    return p >= min_p.float()[:, None] * p.amax(dim=-1, keepdim=True)


@op(family="sampling", outputs=("logits",), compare=EXACT, golden_precision="native", in_place="logits")
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured output: forbid tokens. logits: [B, V] float (modified in place and returned);
    bitmask: [B, ceil(V/32)] int32, bit (v % 32) of word v // 32 set = token v allowed (xgrammar's
    layout; bit 31 is the int32 sign bit). Forbidden logits become -inf.
    """
    rows, vocab = logits.shape
    if tuple(bitmask.shape) != (rows, (vocab + 31) // 32):
        raise ValueError(f"bitmask has shape {tuple(bitmask.shape)}, expected ({rows}, {(vocab + 31) // 32}) for logits {tuple(logits.shape)}")
    # Widen to int64 and keep the low 32 bits, so bit 31 reads as an ordinary bit, not a sign.
    words = bitmask.long() & 0xFFFFFFFF
    bit_index = torch.arange(32, device=bitmask.device, dtype=torch.int64)
    allowed = ((words[:, :, None] >> bit_index) & 1).flatten(1)[:, :vocab].bool()
    return logits.masked_fill_(~allowed, float("-inf"))
