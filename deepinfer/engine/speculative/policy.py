"""How many of its drafts each request verifies in a step.

FixedPolicy: all of them (up to k), as vLLM and SGLang do.

ConfidencePolicy (DSpark's idea): draft i of a request is accepted with probability a_i given the
ones before it were (AcceptanceEstimator), so verifying it adds prod_{j <= i} a_j expected tokens.
Those gains fall along each request's drafts, so the best n drafts to verify over the batch are
the n largest gains (each request's verified drafts stay a prefix). The step then yields
B + (sum of those gains) expected tokens (every request gets at least its bonus token) in
draft time + step(B + n) seconds (StepCostModel); the policy verifies the n that maximises the
ratio. At low load extra tokens are almost free and it verifies nearly everything; as the step
becomes compute-bound, only the likely drafts are worth their time.

With device graphs (`padded`), a verification step runs as a graph of (batch bucket, S) rows per
request: every request is padded to the longest one's 1 + k rows, so the step costs step(B x S)
whatever the others verify, and drafts up to S - 1 are free for every request. The policy then
picks S: each request verifies min(S - 1, its drafts), and S maximises expected tokens per second.
"""

from __future__ import annotations

from deepinfer.engine.speculative.acceptance import AcceptanceEstimator
from deepinfer.engine.speculative.cost_model import StepCostModel


class FixedPolicy:
    def choose(self, requests: list[int], confidences: list[list[float]]) -> list[int]:
        return [len(c) for c in confidences]

    def record(self, request: int, confidences: list[float], num_accepted: int) -> None:
        """Verifying every draft needs no acceptance record."""

    def forget(self, request: int) -> None:
        """No per-request state is kept."""


class ConfidencePolicy:
    def __init__(self, cost: StepCostModel, estimator: AcceptanceEstimator | None = None, padded: bool = False):
        """padded: verification steps run padded to the longest request (device graphs)."""
        self.cost = cost
        self.estimator = estimator or AcceptanceEstimator()
        self.padded = padded

    def _reaches(self, requests: list[int], confidences: list[list[float]]) -> list[list[float]]:
        """reaches[b][i]: the probability that request b's drafts 0..i are all accepted."""
        reaches = []
        for request, confs in zip(requests, confidences):
            reach, row = 1.0, []
            for confidence in confs:
                reach *= self.estimator.probability(request, confidence)
                row.append(reach)
            reaches.append(row)
        return reaches

    def choose(self, requests: list[int], confidences: list[list[float]]) -> list[int]:
        """requests: their ids; confidences[b]: request b's drafts' confidences (len: drafts it
        may verify). Returns how many each verifies."""
        reaches = self._reaches(requests, confidences)
        if self.padded:
            return self._choose_padded(reaches)
        gains = sorted((-reach, b, i) for b, row in enumerate(reaches) for i, reach in enumerate(row))
        batch = len(requests)
        draft = self.cost.draft_seconds * batch
        expected, best, best_n = float(batch), batch / (draft + self.cost.step(batch)), 0
        for n, (neg_gain, _, _) in enumerate(gains, start=1):
            expected -= neg_gain
            rate = expected / (draft + self.cost.step(batch + n))
            if rate > best:
                best, best_n = rate, n
        chosen = [0] * batch
        for _, b, _ in gains[:best_n]:
            chosen[b] += 1
        return chosen

    def _choose_padded(self, reaches: list[list[float]]) -> list[int]:
        batch = len(reaches)
        draft = self.cost.draft_seconds * batch
        longest = max((len(row) for row in reaches), default=0)
        best, best_drafts = -1.0, 0
        for drafts in range(longest + 1):  # S = 1 + drafts rows per request
            expected = batch + sum(sum(row[:drafts]) for row in reaches)
            rate = expected / (draft + self.cost.step(batch * (1 + drafts)))
            if rate > best:
                best, best_drafts = rate, drafts
        return [min(best_drafts, len(row)) for row in reaches]

    def record(self, request: int, confidences: list[float], num_accepted: int) -> None:
        self.estimator.record(request, confidences, num_accepted)

    def forget(self, request: int) -> None:
        self.estimator.forget(request)
