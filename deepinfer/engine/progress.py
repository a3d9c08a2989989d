"""The progress bar of a generation: requests done, tokens generated, prompt and generation tok/s.

Requests alone do not move while one long request decodes, so the bar also shows the tokens
generated so far and both rates (vLLM's bar shows the same two rates), refreshed after a step at
most every REFRESH_S seconds. Rates keep three significant digits: a slow backend (the Triton
interpreter) runs well under one token per second, and "0.0 tok/s" is not a rate.
"""

from __future__ import annotations

import time

REFRESH_S = 0.5


def rate(per_second: float) -> str:
    """A rate with at least three significant digits: 1234, 45.6, 0.123, 0.000123 (0 only for 0)."""
    if per_second >= 100:
        return f"{per_second:.0f}"
    return f"{per_second:.3g}"


class Progress:
    """A tqdm bar over `total` requests that also shows token counts and rates. Callers pass the
    counts since they started (tokens over all the ranks they speak for)."""

    def __init__(self, total: int, enabled: bool, desc: str = "Processed prompts"):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, disable=not enabled)
        self.start = self.last_refresh = time.perf_counter()

    def update(self, finished: int, prompt_tokens: int, generated_tokens: int) -> None:
        """`finished` requests more are done; the token counts are totals since the start."""
        now = time.perf_counter()
        elapsed = max(now - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"{generated_tokens} tok generated, prompt {rate(prompt_tokens / elapsed)} tok/s, generation {rate(generated_tokens / elapsed)} tok/s",
            refresh=False,
        )
        if finished:
            self.bar.update(finished)  # redraws
            self.last_refresh = now
        elif now - self.last_refresh >= REFRESH_S:
            self.bar.refresh()
            self.last_refresh = now

    def close(self) -> None:
        self.bar.close()
