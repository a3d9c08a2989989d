"""The sampling ops' references against independent Python computations."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.ops.sampling import _keep_top_p, apply_token_bitmask, sample, sampling_uniform

M32 = 0xFFFFFFFF

# ---------------------------------------------------------------------------------------------
# The hash, in Python integers
# ---------------------------------------------------------------------------------------------


def py_mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x21F0AAAD) % 2**32
    x ^= x >> 15
    x = (x * 0xD35A2D97) % 2**32
    return x ^ (x >> 15)


def py_uniform(seed: int, position: int, v: int) -> float:
    seed_lo, seed_hi = seed % 2**32, (seed // 2**32) % 2**32  # two's complement halves
    row = py_mix(py_mix(py_mix((seed_lo + 0x9E3779B9) % 2**32) ^ seed_hi) ^ (position % 2**32))
    return ((py_mix(row ^ v) >> 9) + 0.5) / 2**23


TRIPLES = [(0, 0, 0), (1, 0, 5), (-1, 3, 999), (2**62 + 12345, 2**33 + 7, 129279), (-(2**40) - 3, 123456, 31), (2**63 - 1, 2**32 - 1, 32)]


def test_sampling_uniform_matches_python_integers():
    seeds = torch.tensor([s for s, _, _ in TRIPLES])
    positions = torch.tensor([p for _, p, _ in TRIPLES])
    u = sampling_uniform(seeds, positions, 129280)
    assert u.dtype == torch.float32 and u.shape == (len(TRIPLES), 129280)
    for b, (seed, position, v) in enumerate(TRIPLES):
        assert u[b, v].item() == py_uniform(seed, position, v)  # exact: float32 holds it exactly


def test_sampling_uniform_whole_rows_match_python_integers():
    """Every vocab index of a few rows: exercises the 32-bit multiply on many operands."""
    seeds, positions = torch.tensor([7, -123456789, 2**61]), torch.tensor([0, 99, 2**40 + 1])
    u = sampling_uniform(seeds, positions, 2048)
    for b in range(3):
        want = [py_uniform(int(seeds[b]), int(positions[b]), v) for v in range(2048)]
        assert u[b].double().tolist() == want


def test_sampling_uniform_range_and_independence():
    seeds = torch.tensor([5, 5, 6])
    positions = torch.tensor([10, 11, 10])
    u = sampling_uniform(seeds, positions, 50_000)
    assert bool(((u > 0) & (u < 1)).all())
    assert abs(u.double().mean().item() - 0.5) < 0.01
    # Same seed at the next position, or another seed at the same position: different noise.
    assert (u[0] != u[1]).float().mean() > 0.99
    assert (u[0] != u[2]).float().mean() > 0.99
    # A row's noise depends on its own (seed, position) only.
    assert torch.equal(sampling_uniform(seeds[1:2], positions[1:2], 50_000)[0], u[1])


# ---------------------------------------------------------------------------------------------
# sample
# ---------------------------------------------------------------------------------------------


def params(batch, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None):
    def full(value, dtype):
        return value if torch.is_tensor(value) else torch.full((batch,), value, dtype=dtype)

    return {
        "temperature": full(temperature, torch.float32),
        "top_k": full(top_k, torch.int32),
        "top_p": full(top_p, torch.float32),
        "min_p": full(min_p, torch.float32),
        "seeds": torch.arange(batch, dtype=torch.int64) * 7919 + 1 if seeds is None else seeds,
        "positions": torch.full((batch,), 17, dtype=torch.int64) if positions is None else positions,
    }


def python_sample(logits: list[float], temperature, top_k, top_p, min_p, seed, position) -> int:
    """The docstring's recipe for one row, in Python floats (float64) with explicit loops."""
    vocab = len(logits)
    if temperature == 0:
        return max(range(vocab), key=lambda v: (logits[v], -v))
    z = [x / temperature for x in logits]
    top = max(z)
    exps = [math.exp(x - top) for x in z]
    p = [e / sum(exps) for e in exps]
    kept = set(range(vocab))
    if 0 < top_k < vocab:
        threshold = sorted(logits, reverse=True)[top_k - 1]
        kept = {v for v in kept if logits[v] >= threshold}
    if top_p < 1:
        mass = sum(p[v] for v in kept)
        q = {v: p[v] / mass for v in kept}
        total, last = 0.0, None
        for v in sorted(q, key=lambda v: -q[v]):
            total, last = total + q[v], q[v]
            if total >= top_p:
                break
        kept = {v for v in kept if q[v] >= last}
    kept = {v for v in kept if p[v] >= min_p * max(p)}
    score = {v: z[v] - math.log(-math.log(py_uniform(seed, position, v))) for v in kept}
    return max(kept, key=lambda v: (score[v], -v))


def random_requests(batch, vocab, seed):
    """Logits (randn * 3) and per-row parameters drawn across every filter and greedy."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * 3
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.7])[torch.randint(0, 4, (batch,), generator=gen)]
    top_k = torch.tensor([0, 1, 5, 20, -1, vocab])[torch.randint(0, 6, (batch,), generator=gen)].int()
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.2])[torch.randint(0, 4, (batch,), generator=gen)]
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.3])[torch.randint(0, 4, (batch,), generator=gen)]
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    positions = torch.randint(0, 10**6, (batch,), generator=gen)
    return logits, params(batch, temperature, top_k, top_p, min_p, seeds, positions)


def test_sample_matches_python_per_row():
    logits, kw = random_requests(240, 64, seed=0)
    tokens = sample(logits, **kw)
    assert tokens.dtype == torch.int64 and tokens.shape == (240,)
    for b in range(240):
        row = {k: v[b].item() for k, v in kw.items()}
        want = python_sample(logits[b].tolist(), row["temperature"], row["top_k"], row["top_p"], row["min_p"], row["seeds"], row["positions"])
        assert tokens[b].item() == want, (b, row)


def test_greedy_is_argmax_with_ties_to_the_lowest_index():
    logits = torch.randn(6, 1003) * 3
    logits[2, [10, 500, 900]] = 100.0  # a three-way tie for the maximum
    kw = params(6, temperature=0.0, top_k=3, top_p=0.5, min_p=0.5)  # filters do not apply
    tokens = sample(logits, **kw)
    assert tokens.tolist() == [int(max(range(1003), key=lambda v: (logits[b, v].item(), -v))) for b in range(6)]
    assert tokens[2].item() == 10


def test_top_k_one_is_argmax_whatever_the_seed():
    logits = torch.randn(1, 1000).repeat(64, 1) * 3
    kw = params(64, temperature=torch.linspace(0.1, 3.0, 64), top_k=1, seeds=torch.arange(64) * 104729 - 5000)
    assert sample(logits, **kw).tolist() == [logits[0].argmax().item()] * 64


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_tokens_follow_the_softmax_distribution():
    """Many seeds over one small-vocab row: frequencies match softmax(logits / T). The seeds are
    fixed, so the statistic is deterministic; the bound is the chi-square 99.99% quantile."""
    draws, logits = 6000, torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    for temperature in (1.0, 0.6):
        kw = params(draws, temperature=temperature, seeds=torch.arange(draws) * 2654435761, positions=torch.arange(draws) % 97)
        counts = torch.bincount(sample(logits.repeat(draws, 1), **kw), minlength=6).double()
        probs = (logits.double() / temperature).softmax(-1)
        assert chi_square(counts, probs) < 25.7  # 5 degrees of freedom


def test_filtered_distribution_is_the_renormalised_softmax():
    draws, logits = 6000, torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, 2.2, 0.5])
    kw = params(draws, top_k=4, seeds=torch.arange(draws) * 6364136223846793005, positions=torch.zeros(draws, dtype=torch.int64))
    counts = torch.bincount(sample(logits.repeat(draws, 1), **kw), minlength=8).double()
    kept = [0, 1, 2, 6]  # the 4 largest logits
    assert counts.sum() == counts[kept].sum()
    assert chi_square(counts[kept], logits[kept].double().softmax(-1)) < 21.2  # 3 degrees of freedom


@pytest.mark.parametrize(
    "filters, allowed",
    [
        (dict(top_k=3), lambda lg, p: lg >= lg.sort(descending=True).values[2]),
        (dict(min_p=0.2), lambda lg, p: p >= 0.2 * p.max()),
        # logits [4, 3.5, 3, ...] at T = 1: p ~ [.47, .28, .17, ...]: top_p 0.7 needs the first two
        (dict(top_p=0.7), lambda lg, p: torch.arange(len(lg)) < 2),
    ],
)
def test_filters_never_sample_a_filtered_token(filters, allowed):
    draws = 3000
    logits = torch.tensor([4.0, 3.5, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0])
    kw = params(draws, **filters, seeds=torch.arange(draws) * 97 + 11)
    tokens = sample(logits.repeat(draws, 1), **kw)
    mask = allowed(logits.double(), logits.double().softmax(-1))
    seen = torch.zeros(8, dtype=torch.bool).index_fill_(0, tokens, True)
    assert torch.equal(seen, mask)  # every allowed token shows up, no other does


def test_top_p_one_is_off_even_where_the_float32_cumsum_reaches_one_early():
    """Rounding can carry the sorted float32 cumulative sum to 1.0 before the row's end; the
    nucleus rule alone would then drop the tail. top_p = 1.0 means off: everything stays."""
    gen = torch.Generator().manual_seed(0)
    rows = [(torch.randn(40, generator=gen) * 8).softmax(-1) for _ in range(200)]
    early = [p for p in rows if (p.sort(descending=True).values.cumsum(-1) < 1.0).sum() < 39]
    assert early  # the situation does occur
    p = torch.stack(early)
    kept = _keep_top_p(p, torch.ones_like(p, dtype=torch.bool), torch.ones(len(early)))
    assert bool(kept.all())


def test_a_request_gets_the_same_token_alone_or_in_a_batch_of_17_others():
    """Batch invariance (the issue's requirement): 18 requests with different parameters, sampled
    together and one by one, over many seeds and positions, and in a shuffled batch order."""
    for trial in range(12):
        logits, kw = random_requests(18, 1003, seed=100 + trial)
        batch_tokens = sample(logits, **kw)
        for b in range(18):
            alone = sample(logits[b:b + 1], **{k: v[b:b + 1] for k, v in kw.items()})
            assert alone.item() == batch_tokens[b].item(), (trial, b)
        order = torch.randperm(18, generator=torch.Generator().manual_seed(trial))
        shuffled = sample(logits[order], **{k: v[order] for k, v in kw.items()})
        assert torch.equal(shuffled, batch_tokens[order])
        # Different parameters really were mixed into the batch.
        assert len(set(kw["temperature"].tolist())) > 1 and len(set(kw["top_k"].tolist())) > 1


def test_same_seed_different_position_changes_the_draw():
    draws, logits = 400, torch.zeros(1, 1000)  # uniform distribution: the noise alone decides
    kw = params(draws, seeds=torch.full((draws,), 42), positions=torch.arange(draws))
    tokens = sample(logits.repeat(draws, 1), **kw)
    assert len(set(tokens.tolist())) > 300
    again = sample(logits.repeat(draws, 1), **kw)
    assert torch.equal(tokens, again)


def test_sample_never_reads_device_values():
    meta, batch = torch.device("meta"), 3
    kw = {k: v.to(meta) for k, v in params(batch).items()}
    assert sample(torch.empty(batch, 100, device=meta), **kw).shape == (batch,)


# ---------------------------------------------------------------------------------------------
# apply_token_bitmask
# ---------------------------------------------------------------------------------------------


def python_apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for b in range(logits.shape[0]):
        for v in range(logits.shape[1]):
            word = int(bitmask[b, v // 32]) & M32  # read the int32 word as unsigned
            if not (word >> (v % 32)) & 1:
                out[b, v] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [33, 1003, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_matches_a_loop_over_bits(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31, (5, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # everything allowed
    bitmask[1] = 0
    bitmask[1, 0] = -(2**31)  # only token 31, the sign bit
    bitmask[2] = -(2**31)  # tokens 31, 63, ...
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    want = python_apply_bitmask(logits, bitmask)
    out = apply_token_bitmask(logits, bitmask)
    assert out is logits and out.dtype == dtype
    assert torch.equal(out, want)
    assert torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [31]
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == list(range(31, vocab, 32))


def test_bitmask_then_sample_stays_inside_the_mask():
    logits = torch.randn(4, 1003) * 3
    bitmask = torch.zeros(4, 32, dtype=torch.int32)
    bitmask[:, 10] = 0b1010  # tokens 321 and 323
    apply_token_bitmask(logits, bitmask)
    tokens = sample(logits, **params(4, temperature=torch.tensor([0.0, 1.0, 1.0, 2.0]), top_p=0.9))
    assert set(tokens.tolist()) <= {321, 323}


def test_bitmask_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="bitmask"):
        apply_token_bitmask(torch.zeros(2, 1003), torch.zeros(2, 31, dtype=torch.int32))
