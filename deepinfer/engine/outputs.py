"""What generate() returns, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's): rank 1 is the most likely token;
    decoded_token is its text alone (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position, {token id: Logprob}: the chosen token first, then the top tokens (vLLM's layout).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" (EOS, a stop token id, a stop string, a completed grammar) | "length" | "error" | "abort" (LLMEngine.abort) | None while running
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS or length
    cumulative_logprob: float | None = None  # the sum of the generated tokens' logprobs (when logprobs was asked for)
    logprobs: list[PositionLogprobs] | None = None  # one per generated token (when logprobs was asked for)
    error: str | None = None  # finish_reason "error": why (its grammar did not compile in time, or failed), on one line

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # per prompt token, None for the first (when asked for)
    metrics: dict = field(default_factory=dict)  # num_preemptions, ...

    def __repr__(self) -> str:
        out = self.outputs[0] if self.outputs else None
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_tokens={len(self.prompt_token_ids)}, text={out.text if out else None!r}, "
            f"finish_reason={out.finish_reason if out else None!r})"
        )
