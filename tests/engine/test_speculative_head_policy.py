"""The head policy (DSpark's): the confidence head's outputs read as each draft's acceptance probability given
the ones before it; a request's drafts verified in order of expected gain while the gain beats the cost of the
wider step. Its decisions for given confidences and step costs, unpadded and padded (device graphs)."""

from __future__ import annotations

import pytest

from deepinfer.engine.speculative.cost_model import StepCostModel
from deepinfer.engine.speculative.head_policy import HeadPolicy, reaches

FLAT = StepCostModel.from_table({1: 0.01, 4096: 0.01}, 0.0)  # any step costs the same
STEEP = StepCostModel.from_table({1: 0.01, 4096: 40.96}, 0.0)  # every token costs a full step
# a token costs 10% of a one-token step beyond the first: a draft pays while its expected gain beats that share
MILD = StepCostModel.from_table({1: 0.01, 2: 0.011, 4096: 0.01 + 4095 * 0.001}, 0.0)

SURE, UNSURE = [0.95] * 5, [0.05] * 5


def test_the_gain_of_a_draft_is_the_product_of_the_confidences_up_to_it():
    assert reaches([[0.5, 0.5, 1.0], []]) == [[0.5, 0.25, 0.25], []]
    assert reaches([[1.5, -0.2]]) == [[1.0, 0.0]]  # out-of-range outputs are clipped to probabilities


def test_flat_costs_verify_everything_and_steep_costs_nothing():
    for padded in (False, True):
        assert HeadPolicy(FLAT, padded=padded).choose([1, 2], [SURE, UNSURE[:2]]) == [5, 2]
        assert HeadPolicy(STEEP, padded=padded).choose([1, 2], [SURE, UNSURE[:2]]) == [0, 0]


def test_a_request_verifies_while_the_gain_beats_the_cost_of_the_wider_step():
    """One request, mild costs: each draft costs 10% of a step, so with E expected tokens in T seconds a draft of
    gain g pays while g / 0.001 > E / T. Confidences 0.9, 0.8, 0.5, 0.2: gains 0.9, 0.72, 0.36, 0.072."""
    policy = HeadPolicy(MILD)
    assert policy.choose([1], [[0.9, 0.8, 0.5, 0.2]]) == [3]  # 0.072 * 0.013 < 2.98 * 0.001: the fourth does not pay
    assert policy.choose([1], [[0.05, 0.99, 0.99]]) == [0]  # the first draft gates the rest: gain 0.05 < 1 * 0.1
    assert policy.choose([1], [[0.99, 0.99, 0.99, 0.99, 0.99]]) == [5]


def test_the_batch_verifies_the_largest_gains_first():
    """Mild costs, a sure and an unsure request: the sure one's drafts pay, the unsure one's never do."""
    assert HeadPolicy(MILD).choose([1, 2], [SURE, UNSURE]) == [5, 0]
    # confident drafts of several requests share the wider step: a third request's gain 0.9 is taken before 0.95^5
    assert HeadPolicy(MILD).choose([1, 2, 3], [SURE, UNSURE, [0.9]]) == [5, 0, 1]


def test_padded_widens_every_request_while_the_rate_rises():
    """Padded, the step costs the longest request's rows for every request: the unsure request verifies as many
    as the sure one, for free; with many unsure requests the padding costs more than the sure drafts bring."""
    assert HeadPolicy(MILD, padded=True).choose([1, 2], [SURE, UNSURE]) == [5, 5]
    assert HeadPolicy(MILD, padded=True).choose([1, 2], [SURE, UNSURE[:1]]) == [5, 1]
    requests, confidences = list(range(32)), [SURE] + [UNSURE] * 31
    # unpadded, at 32 requests the step already yields ~790 tokens/s: the sure request's fifth draft (gain 0.77,
    # 774 tokens/s for its extra millisecond) no longer pays
    assert HeadPolicy(MILD).choose(requests, confidences) == [4] + [0] * 31
    assert HeadPolicy(MILD, padded=True).choose(requests, confidences) == [0] * 32


@pytest.mark.parametrize("padded", [False, True])
def test_it_keeps_no_state(padded):
    policy = HeadPolicy(MILD, padded=padded)
    before = policy.choose([1], [[0.9, 0.8, 0.5, 0.2]])
    policy.record(1, [0.9, 0.8, 0.5], 0)
    policy.forget(1)
    assert policy.choose([1], [[0.9, 0.8, 0.5, 0.2]]) == before
