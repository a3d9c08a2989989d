"""Timing the forwards the confidence policy's cost model is fitted to (cost_model.fit).

The target's forward over T tokens at T = 1, 2, 4, ... up to the most tokens a verification step
can hold, and the draft layer's over the largest T; the device synchronised around each run. Each
T runs at least MIN_REPEATS timed times, and more, up to MAX_REPEATS, while its timed runs add up to
less than POINT_BUDGET_S: small steps, the noisiest relative to their length, get more runs for
little time. An untimed run comes first: before every T where the backend does first-use work per
shape (compiles kernels, captures a device graph), else only before the first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

MIN_REPEATS = 3
MAX_REPEATS = 9
POINT_BUDGET_S = 0.25


@dataclass
class CostSamples:
    steps: dict[int, list[float]] = field(default_factory=dict)  # tokens -> seconds of each timed target forward
    draft_tokens: int = 1
    draft: list[float] = field(default_factory=list)  # seconds of each timed draft forward over draft_tokens requests

    def as_dict(self) -> dict:
        return {"steps": {str(t): runs for t, runs in self.steps.items()}, "draft_tokens": self.draft_tokens, "draft": self.draft}

    @classmethod
    def from_dict(cls, data: dict) -> "CostSamples":
        """The inverse of as_dict (a cached measurement); ValueError / TypeError / KeyError when it is not one."""
        steps = {int(t): [float(s) for s in runs] for t, runs in data["steps"].items()}
        return cls(steps, int(data["draft_tokens"]), [float(s) for s in data["draft"]])


def token_points(max_tokens: int) -> list[int]:
    """1, 2, 4, ... and max_tokens last."""
    points, t = [], 1
    while t < max_tokens:
        points.append(t)
        t *= 2
    return points + [max_tokens]


def measure(
    target_forward: Callable[[int], None], draft_forward: Callable[[int], None] | None, max_tokens: int, synchronize: Callable[[], None],
    warm_each_shape: bool = True, on_point: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter,
) -> CostSamples:  # fmt: skip
    """target_forward(T) / draft_forward(T) run one forward over T one-token sequences (no
    draft_forward: drafting costs nothing); synchronize() waits for the device; warm_each_shape: an
    untimed run before each T (module docstring); on_point() is called after each measured point
    (progress); clock() reads seconds."""
    warmed = set()

    def timed(fn, n: int) -> list[float]:
        if warm_each_shape or fn not in warmed:
            fn(n)
            synchronize()
            warmed.add(fn)
        runs: list[float] = []
        while len(runs) < MIN_REPEATS or (len(runs) < MAX_REPEATS and sum(runs) < POINT_BUDGET_S):
            start = clock()
            fn(n)
            synchronize()
            runs.append(clock() - start)
        return runs

    points = token_points(max_tokens)
    samples = CostSamples(draft_tokens=points[-1])
    for n in points:
        samples.steps[n] = timed(target_forward, n)
        if on_point is not None:
            on_point()
    if draft_forward is not None:
        samples.draft = timed(draft_forward, points[-1])
        if on_point is not None:
            on_point()
    return samples
