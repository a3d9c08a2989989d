"""Step time as a function of the tokens in the step, for the confidence policy.

StepCostModel: a table of (tokens, seconds), interpolated linearly between its points and
extrapolated from its last two (a user's `cost_model`, or a fit below).

fit(samples): the model a measurement gives (deepinfer.engine.speculative.cost_measure times the
forwards). A pure function of the timed runs, so that the policy's decisions do not follow the noise
of one measurement: each point's runs give their median, and over the points a "roofline" hinge is
fitted, flat up to a knee then linear,

    step(T) = flat + per_token * max(0, T - knee),

by least relative absolute deviation (the sum over points of |measured - fitted| / measured, which a
point thrown off by a burst of other work moves little). A step is bound by reading the weights
until enough tokens share them, then by compute: the hinge is that curve's shape. Interpolating the
medians instead let one slow point make a range of steps look flat (free drafts) or steep (no
drafts), so the same run verified 0.00 drafts per request and step once and 2.40 the next.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass


@dataclass
class StepCostModel:
    tokens: list[int]  # ascending
    seconds: list[float]  # target forward with that many tokens
    draft_seconds: float  # one draft forward, per request of the step

    @classmethod
    def from_table(cls, table: dict[int, float], draft_seconds: float) -> "StepCostModel":
        tokens = sorted(table)
        return cls(tokens, [table[t] for t in tokens], draft_seconds)

    def step(self, tokens: int) -> float:
        """Seconds of a target forward over `tokens` tokens."""
        xs, ys = self.tokens, self.seconds
        if len(xs) == 1:
            return ys[0] * max(1.0, tokens / xs[0])
        i = min(max(bisect.bisect_left(xs, tokens), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0), 1e-9)

    def as_dict(self) -> dict:
        return {**{str(t): s for t, s in zip(self.tokens, self.seconds)}, "draft": self.draft_seconds}


@dataclass(frozen=True)
class HingeFit:
    """step(T) = flat + per_token * max(0, T - knee); draft: seconds of one draft forward per request."""

    flat: float
    knee: int
    per_token: float
    draft: float

    def model(self) -> StepCostModel:
        """The hinge as a table (flat from 1 to the knee, the slope extrapolated past it)."""
        if self.knee > 1:
            table = {1: self.flat, self.knee: self.flat, 2 * self.knee: self.flat + self.per_token * self.knee}
        else:
            table = {1: self.flat, 2: self.flat + self.per_token}
        return StepCostModel.from_table(table, self.draft)

    def describe(self) -> str:
        flat = f"{self.flat * 1e3:.3g} ms a step of 1 token" if self.knee == 1 else f"{self.flat * 1e3:.3g} ms a step of up to {self.knee} tokens"
        return f"{flat}, {self.per_token * 1e3:.3g} ms each token more; drafting {self.draft * 1e3:.3g} ms a request"


def fit(steps: dict[int, list[float]], draft_tokens: int = 1, draft: list[float] | tuple[float, ...] = ()) -> HingeFit:
    """The hinge through the timed runs (module docstring). steps: tokens -> seconds of each timed
    target forward; draft: seconds of each timed draft forward over draft_tokens requests (none: no
    draft model runs, drafting costs nothing)."""
    if not steps or any(not runs for runs in steps.values()):
        raise ValueError("fit needs at least one timed run at each measured token count")
    points = sorted((t, statistics.median(runs)) for t, runs in steps.items())
    if any(t < 1 or not y > 0 for t, y in points):
        raise ValueError(f"fit needs token counts >= 1 and times > 0, got {points}")
    # a knee leaves at least two points on the slope to fit it (one when only two are measured)
    knees = [t for t, _ in points[: max(1, len(points) - 2)]]
    best = None
    for knee in knees:
        xs = [max(0, t - knee) for t, _ in points]
        for flat, per_token in _candidates(xs, [y for _, y in points]):
            error = sum(abs(y - flat - per_token * x) / y for x, (_, y) in zip(xs, points))
            if best is None or error < best[0]:
                best = (error, flat, knee, per_token)
    _, flat, knee, per_token = best
    per_request = statistics.median(draft) / draft_tokens if draft else 0.0
    return HingeFit(flat, knee, per_token, per_request)


def _candidates(xs: list[int], ys: list[float]):
    """(flat, per_token) lines an L1 optimum can be: through two points of distinct x (a non-negative
    slope and a positive level), or level through one point."""
    for y in ys:
        yield y, 0.0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            if xs[i] != xs[j]:
                per_token = (ys[j] - ys[i]) / (xs[j] - xs[i])
                flat = ys[i] - per_token * xs[i]
                if per_token >= 0 and flat > 0:
                    yield flat, per_token
