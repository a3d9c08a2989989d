"""Step time as a function of the tokens in the step, for the confidence policy.

Measured on the device when the engine starts (`measure`): the target's forward over T one-token
sequences and the draft layer's over the same, timed at T = 1, 2, 4, ... up to the most tokens a
verification step can hold, the device synchronised around each; between measured points the time
is interpolated linearly, past the last one extrapolated from the last two.
"""

from __future__ import annotations

import bisect
import logging
import statistics
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


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


def measure(target_forward, draft_forward, max_tokens: int, synchronize, repeats: int = 3) -> StepCostModel:
    """target_forward(T) / draft_forward(T) run one forward over T one-token sequences (no
    draft_forward: drafting costs nothing);
    synchronize() waits for the device. Times T = 1, 2, 4, ... up to max_tokens (the median of
    `repeats` runs after one warm-up run)."""
    points = []
    t = 1
    while True:
        points.append(min(t, max_tokens))
        if t >= max_tokens:
            break
        t *= 2

    def timed(fn, n: int) -> float:
        fn(n)
        synchronize()
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(n)
            synchronize()
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    table = {n: timed(target_forward, n) for n in points}
    per_request = timed(draft_forward, points[-1]) / points[-1] if draft_forward is not None else 0.0
    model = StepCostModel.from_table(table, per_request)
    log.info("speculative cost model (seconds by tokens): %s", model.as_dict())
    return model
