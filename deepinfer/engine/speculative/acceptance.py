"""Per-draft acceptance probabilities for the confidence policy, calibrated online.

A draft comes with a confidence in [0, 1] (the MTP layer's top-1 probability, or a confidence
head's output). Its acceptance probability, given that every draft before it was accepted, is
read from 10 confidence bins: each request's own record in the bin, shrunk towards the engine-wide
record of the bin, itself shrunk towards the bin's centre (a calibrated confidence) while it has
seen little. Only drafts whose verification was decided count: accepted ones, and the first
rejected one of a step (the ones after it were never tested).
"""

from __future__ import annotations

BINS = 10
PRIOR = 2.0  # weight of the bin centre in the engine-wide estimate, in drafts
REQUEST_PRIOR = 4.0  # weight of the engine-wide estimate in a request's, in drafts


def _bin(confidence: float) -> int:
    return min(BINS - 1, max(0, int(confidence * BINS)))


class AcceptanceEstimator:
    def __init__(self):
        self.accepted = [0.0] * BINS
        self.seen = [0.0] * BINS
        self.requests: dict[int, tuple[list[float], list[float]]] = {}

    def global_rate(self, b: int) -> float:
        centre = (b + 0.5) / BINS
        return (self.accepted[b] + PRIOR * centre) / (self.seen[b] + PRIOR)

    def probability(self, request: int, confidence: float) -> float:
        b = _bin(confidence)
        rate = self.global_rate(b)
        own = self.requests.get(request)
        if own is None:
            return rate
        accepted, seen = own
        return (accepted[b] + REQUEST_PRIOR * rate) / (seen[b] + REQUEST_PRIOR)

    def record(self, request: int, confidences: list[float], num_accepted: int) -> None:
        """A step verified len(confidences) drafts of `request` and accepted the first num_accepted."""
        accepted, seen = self.requests.setdefault(request, ([0.0] * BINS, [0.0] * BINS))
        for i, confidence in enumerate(confidences[: num_accepted + 1]):
            b = _bin(confidence)
            hit = float(i < num_accepted)
            accepted[b] += hit
            seen[b] += 1
            self.accepted[b] += hit
            self.seen[b] += 1

    def forget(self, request: int) -> None:
        self.requests.pop(request, None)
