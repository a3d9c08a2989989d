"""The verification-length policies on their own: which drafts the confidence policy verifies for a
given step cost, unpadded (each request's drafts priced by the tokens they add) and padded (device
graphs: a step costs its longest request's rows for every request)."""

from __future__ import annotations

from deepinfer.engine.speculative.cost_model import StepCostModel
from deepinfer.engine.speculative.policy import ConfidencePolicy, FixedPolicy

FLAT = StepCostModel.from_table({1: 0.01, 4096: 0.01}, 0.0)  # any step costs the same
STEEP = StepCostModel.from_table({1: 0.01, 4096: 40.96}, 0.0)  # every token costs a full step
# a token costs 10% of a one-token step: a draft pays when it is accepted with probability > ~0.1
MILD = StepCostModel.from_table({1: 0.01, 2: 0.011, 4096: 0.01 + 4095 * 0.001}, 0.0)

SURE, UNSURE = [0.95] * 4, [0.05] * 4  # confidences of a request's 4 drafts (the estimator's prior: the bin centre)


def test_fixed_verifies_every_draft():
    assert FixedPolicy().choose([1, 2], [SURE, UNSURE[:2]]) == [4, 2]


def test_flat_costs_verify_everything_and_steep_costs_nothing():
    for padded in (False, True):
        assert ConfidencePolicy(FLAT, padded=padded).choose([1, 2], [SURE, UNSURE[:2]]) == [4, 2]
        assert ConfidencePolicy(STEEP, padded=padded).choose([1, 2], [SURE, UNSURE[:2]]) == [0, 0]


def test_unpadded_prices_each_draft_padded_gives_the_longest_run_to_every_request():
    """With mild costs the sure request's drafts pay and the unsure one's do not; padded, the step
    costs the sure request's rows anyway, so the unsure request verifies as many (for free)."""
    assert ConfidencePolicy(MILD).choose([1, 2], [SURE, UNSURE]) == [4, 0]
    assert ConfidencePolicy(MILD, padded=True).choose([1, 2], [SURE, UNSURE]) == [4, 4]
    # padded, a request verifies at most the drafts it has
    assert ConfidencePolicy(MILD, padded=True).choose([1, 2], [SURE, UNSURE[:1]]) == [4, 1]


def test_padded_picks_the_rows_per_request_by_expected_tokens_per_second():
    """Many unsure requests and one sure one: padding every request to the sure one's rows costs more
    than its drafts bring, so the step verifies none (unpadded, the sure request alone verifies)."""
    requests, confidences = list(range(32)), [SURE] + [UNSURE] * 31
    assert ConfidencePolicy(MILD).choose(requests, confidences) == [4] + [0] * 31
    assert ConfidencePolicy(MILD, padded=True).choose(requests, confidences) == [0] * 32
