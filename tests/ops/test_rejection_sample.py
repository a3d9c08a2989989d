"""rejection_sample's reference: the acceptance rule, and the distributions speculative sampling must give.

The statistical tests use fixed seeds, so they are deterministic; their thresholds are stated where
they are used (chi-square p-value > 1e-3, the acceptance rate within 3.29 binomial standard errors:
a two-sided 1e-3 bound).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops.rejection_sampling import rejection_sample
from deepinfer.ops.sampling import sample

P_VALUE = 1e-3  # chi-square tests: fail below this p-value
Z_BOUND = 3.29  # binomial bound: |rate - p| <= 3.29 standard errors (two-sided 1e-3 under the normal approximation)


def requests(counts: list[int], temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None) -> dict:
    """Per-request arguments (cu_rows and the sampling parameters) for requests of `counts` rows."""
    n = len(counts)

    def full(value, dtype):
        return value.to(dtype) if isinstance(value, torch.Tensor) else torch.full((n,), value, dtype=dtype)

    return {
        "cu_rows": torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32),
        "temperature": full(temperature, torch.float32),
        "top_k": full(top_k, torch.int32),
        "top_p": full(top_p, torch.float32),
        "min_p": full(min_p, torch.float32),
        "seeds": torch.arange(n, dtype=torch.int64) * 7919 + 1 if seeds is None else seeds,
        "positions": torch.arange(n, dtype=torch.int64) * 3 if positions is None else positions,
    }


def row_tokens(logits: torch.Tensor, kw: dict) -> torch.Tensor:
    """What `sample` draws at every row: its request's parameters, position + the row's index."""
    cu = kw["cu_rows"].long()
    owner = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    index = torch.arange(len(owner)) - cu[:-1][owner]
    per_row = [kw[k][owner] for k in ("temperature", "top_k", "top_p", "min_p", "seeds")]
    return sample(logits, *per_row, kw["positions"][owner] + index)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic against probs (summing to 1 over the counted categories), its p-value:
    the chi-square survival function Q(df / 2, x / 2), df = categories - 1."""
    counts, probs = counts.double(), probs.double()
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(counts) - 1) / 2, dtype=torch.float64), stat / 2))


# ---------------------------------------------------------------------------------------------
# the acceptance rule


def test_greedy_drafts_are_accepted_while_they_equal_the_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g) * 3
    argmax = logits.argmax(-1)
    kw = requests([5])
    # drafts 0 and 1 are the argmax, draft 2 is not: rows 0-2 kept (row 2's token the correction), rows 3-4 -1
    drafts = torch.tensor([argmax[0], argmax[1], (argmax[2] + 1) % 50, argmax[3], -1])
    got = rejection_sample(logits, drafts, **kw)
    assert got.dtype == torch.int64 and got.tolist() == [argmax[0], argmax[1], argmax[2], -1, -1]
    # every draft the argmax: all kept, the bonus row's token the argmax of the last row
    assert torch.equal(rejection_sample(logits, torch.cat([argmax[:4], torch.tensor([-1])]), **kw), argmax)
    # the first draft wrong: only its correction is kept
    first_wrong = torch.cat([((argmax[:1] + 7) % 50), argmax[1:4], torch.tensor([-1])])
    assert rejection_sample(logits, first_wrong, **kw).tolist() == [argmax[0], -1, -1, -1, -1]


def test_rows_after_the_stop_are_minus_one_in_every_request_of_a_batch():
    g = torch.Generator().manual_seed(1)
    counts = [4, 1, 3, 2, 6]
    logits = torch.randn(sum(counts), 30, generator=g) * 2
    kw = requests(counts, temperature=torch.tensor([0.0, 1.0, 0.8, 0.0, 1.2]), top_k=torch.tensor([0, 0, 10, 0, 0]),
                  top_p=torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0]))  # fmt: skip
    drawn = row_tokens(logits, kw)
    accepted = [2, 0, 2, 0, 3]  # drafts equal to the drawn tokens before the first wrong one (or the bonus row)
    drafts = drawn.clone()
    starts = kw["cu_rows"][:-1].tolist()
    for start, count, a in zip(starts, counts, accepted):
        if a < count - 1:
            drafts[start + a] = (drawn[start + a] + 1) % 30
        drafts[start + count - 1] = -1
    got = rejection_sample(logits, drafts, **kw)
    for start, count, a in zip(starts, counts, accepted):
        kept = min(a, count - 1) + 1  # the accepted drafts and the token after them
        assert got[start : start + kept].tolist() == drawn[start : start + kept].tolist()
        assert got[start + kept : start + count].tolist() == [-1] * (count - kept)
    # each request's tokens are the ones it gets alone
    for b, (start, count) in enumerate(zip(starts, counts)):
        alone = {k: v[b : b + 1] for k, v in kw.items() if k != "cu_rows"}
        rows = slice(start, start + count)
        single = rejection_sample(logits[rows], drafts[rows], cu_rows=torch.tensor([0, count], dtype=torch.int32), **alone)
        assert torch.equal(single, got[rows])


def test_a_request_without_drafts_returns_its_sampled_bonus_token():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 100, generator=g) * 2
    kw = requests([1, 1, 1], temperature=torch.tensor([0.0, 1.0, 0.7]), top_k=torch.tensor([0, 0, 20]), min_p=torch.tensor([0.0, 0.05, 0.0]),
                  seeds=torch.tensor([5, -(2**40), 99]), positions=torch.tensor([0, 17, 2**33]))  # fmt: skip
    got = rejection_sample(logits, torch.full((3,), -1), **kw)
    per_request = [kw[k] for k in ("temperature", "top_k", "top_p", "min_p", "seeds", "positions")]
    assert torch.equal(got, sample(logits, *per_request))
    assert got[0] == logits[0].argmax()


def test_a_request_without_rows_is_refused():
    with pytest.raises(ValueError, match="at least one row"):
        rejection_sample(torch.zeros(2, 4), torch.full((2,), -1), **requests([2, 0]))


# ---------------------------------------------------------------------------------------------
# the distributions (20000 one-draft requests on the same logits, fixed seeds)

DRAWS = 20000
LOGITS = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0], [0.0, 1.5, -1.0, 0.3, 0.8, -0.2]])  # the draft row, then the bonus row
DRAFT = 1  # p(1) ~ 0.12 at temperature 1


@pytest.fixture(scope="module")
def one_draft_requests():
    kw = requests([2] * DRAWS, temperature=1.0, seeds=torch.arange(DRAWS, dtype=torch.int64) * 2654435761 + 12345,
                  positions=torch.arange(DRAWS, dtype=torch.int64) % 101)  # fmt: skip
    drafts = torch.tensor([DRAFT, -1]).repeat(DRAWS)
    tokens = rejection_sample(LOGITS.repeat(DRAWS, 1), drafts, **kw)
    return tokens[0::2], tokens[1::2]


def test_the_first_token_follows_the_target_distribution(one_draft_requests):
    first, _ = one_draft_requests
    p = LOGITS[0].double().softmax(-1)
    assert chi_square_p_value(torch.bincount(first, minlength=6), p) > P_VALUE


def test_the_draft_is_accepted_with_its_target_probability(one_draft_requests):
    first, bonus = one_draft_requests
    accepted = first == DRAFT
    p_d = float(LOGITS[0].double().softmax(-1)[DRAFT])
    bound = Z_BOUND * (p_d * (1 - p_d) / DRAWS) ** 0.5
    assert abs(float(accepted.double().mean()) - p_d) <= bound
    # accepted: the bonus row is sampled (from the next position's distribution); rejected: -1
    assert bool((bonus[accepted] >= 0).all()) and bool((bonus[~accepted] == -1).all())
    assert chi_square_p_value(torch.bincount(bonus[accepted], minlength=6), LOGITS[1].double().softmax(-1)) > P_VALUE


def test_a_rejected_draft_is_corrected_from_the_target_without_it(one_draft_requests):
    first, _ = one_draft_requests
    corrections = first[first != DRAFT]
    others = [v for v in range(6) if v != DRAFT]
    p = LOGITS[0].double().softmax(-1)[others]
    counts = torch.bincount(corrections, minlength=6)
    assert counts[DRAFT] == 0
    assert chi_square_p_value(counts[others], p / p.sum()) > P_VALUE
