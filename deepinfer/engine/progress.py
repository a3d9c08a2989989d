"""The progress bar of a generation: requests done, tokens generated, input and output tok/s.

Requests alone do not move while one long request decodes, so the bar also shows the tokens
generated so far and both rates, refreshed after a step at most every REFRESH_S seconds. The rates
are vLLM's bar's "est. speed input / output": prompt and generated tokens over the time elapsed (not
over prefill or decode time alone). Rates keep three significant digits: a slow backend (the Triton
interpreter) runs well under one token per second, and "0.0 tok/s" is not a rate.

A live bar is drawn only on a terminal (or in a notebook). Written to a file or a pipe, its redrawn
frames would splice into the completions printed between them and repeat its last frame on close, so
there it is a plain line instead: one every LOG_EVERY_S while the run lasts, and one at the end.
"""

from __future__ import annotations

import sys
import time

REFRESH_S = 0.5
LOG_EVERY_S = 30.0


def rate(per_second: float) -> str:
    """A rate with at least three significant digits: 1234, 45.6, 0.123, 0.000123 (0 only for 0)."""
    if per_second >= 100:
        return f"{per_second:.0f}"
    return f"{per_second:.3g}"


def draws_live() -> bool:
    """Whether a live bar can be drawn: stderr is a terminal, or tqdm.auto draws a notebook widget."""
    from tqdm.auto import tqdm

    if any(cls.__module__ == "tqdm.notebook" for cls in tqdm.__mro__):
        return True
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """A tqdm bar over `total` requests that also shows token counts and rates (a line now and
    then where no live bar can be drawn: `draws_live`). Callers pass the counts since they started
    (tokens over all the ranks they speak for)."""

    def __init__(self, total: int, enabled: bool, desc: str = "Processed prompts"):
        self.total, self.desc, self.done, self.counts = total, desc, 0, ""
        self.start = self.last_refresh = time.perf_counter()
        self.bar = None
        self.lines = enabled and not draws_live()
        if enabled and not self.lines:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True)

    def update(self, finished: int, prompt_tokens: int, generated_tokens: int) -> None:
        """`finished` requests more are done; the token counts are totals since the start."""
        now = time.perf_counter()
        elapsed = max(now - self.start, 1e-9)
        self.done += finished
        speeds = f"est. speed input {rate(prompt_tokens / elapsed)} tok/s, output {rate(generated_tokens / elapsed)} tok/s"
        self.counts = f"{generated_tokens} tok generated, {speeds}"
        if self.lines:
            if now - self.last_refresh >= LOG_EVERY_S:
                self._line(now)
            return
        if self.bar is None:
            return
        self.bar.set_postfix_str(self.counts, refresh=False)
        if finished:
            self.bar.update(finished)  # redraws
            self.last_refresh = now
        elif now - self.last_refresh >= REFRESH_S:
            self.bar.refresh()
            self.last_refresh = now

    def _line(self, now: float) -> None:
        line = f"{self.desc}: {self.done}/{self.total} requests in {now - self.start:.1f} s" + (f", {self.counts}" if self.counts else "")
        print(line, file=sys.stderr, flush=True)
        self.last_refresh = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.lines:
            self._line(time.perf_counter())
            self.lines = False  # once
