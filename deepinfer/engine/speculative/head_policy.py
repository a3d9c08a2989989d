"""HeadPolicy: how many drafts each request verifies, read off a confidence head (DSpark's).

DSpark's confidence head is trained to predict c_i, the probability that draft i is accepted given that the
drafts before it were. So verifying draft i of a request adds g_i = c_1 c_2 ... c_i expected tokens, and those
gains fall along each request's drafts: the drafts worth verifying over the batch are the largest gains, and
each request's stay a prefix. The policy takes them in that order and verifies the next one while its expected
gain beats the cost of the wider step: while g / (step(B + n + 1) - step(B + n)) exceeds the step's expected
tokens per second so far, E / (draft time + step(B + n)) with E = B + the gains taken (every request emits at
least its bonus token; StepCostModel prices the steps). Below the device's knee a wider step costs almost
nothing and every draft is verified; past it only the likely ones are.

Unlike ConfidencePolicy it does not calibrate the confidences online (the head is the calibration), and it
stops at the first draft that does not pay rather than searching every width. With device graphs (`padded`)
a step costs step(B x S) whatever each request verifies, so it widens S (each request verifying
min(S - 1, its drafts)) while a wider S raises the expected tokens per second.
"""

from __future__ import annotations

from deepinfer.engine.speculative.cost_model import StepCostModel


def reaches(confidences: list[list[float]]) -> list[list[float]]:
    """reaches[b][i]: the probability that request b's drafts 0..i are all accepted (the running product)."""
    out = []
    for confs in confidences:
        reach, row = 1.0, []
        for c in confs:
            reach *= min(1.0, max(0.0, c))
            row.append(reach)
        out.append(row)
    return out


class HeadPolicy:
    def __init__(self, cost: StepCostModel, padded: bool = False):
        """padded: verification steps run padded to the longest request (device graphs)."""
        self.cost = cost
        self.padded = padded

    def choose(self, requests: list[int], confidences: list[list[float]]) -> list[int]:
        """requests: their ids; confidences[b]: request b's drafts' confidences (len: drafts it may verify).
        Returns how many each verifies."""
        gains = reaches(confidences)
        if self.padded:
            return self._choose_padded(gains)
        batch = len(requests)
        draft = self.cost.draft_seconds * batch
        ordered = sorted((-g, b, i) for b, row in enumerate(gains) for i, g in enumerate(row))
        expected, seconds, chosen = float(batch), draft + self.cost.step(batch), [0] * batch
        for n, (neg_gain, b, _) in enumerate(ordered):
            wider = draft + self.cost.step(batch + n + 1)
            if -neg_gain * seconds <= expected * (wider - seconds):  # gain / extra time <= expected / time: it does not pay
                break
            expected, seconds = expected - neg_gain, wider
            chosen[b] += 1
        return chosen

    def _choose_padded(self, gains: list[list[float]]) -> list[int]:
        batch = len(gains)
        draft = self.cost.draft_seconds * batch
        longest = max((len(row) for row in gains), default=0)
        expected, seconds, drafts = float(batch), draft + self.cost.step(batch), 0
        while drafts < longest:
            wider_expected = expected + sum(row[drafts] for row in gains if len(row) > drafts)
            wider = draft + self.cost.step(batch * (drafts + 2))
            if wider_expected * seconds <= expected * wider:  # the wider step's tokens per second are not higher
                break
            expected, seconds, drafts = wider_expected, wider, drafts + 1
        return [min(drafts, len(row)) for row in gains]

    def record(self, request: int, confidences: list[float], num_accepted: int) -> None:
        """The head's confidences are used as they are: nothing to calibrate."""

    def forget(self, request: int) -> None:
        """No per-request state is kept."""
