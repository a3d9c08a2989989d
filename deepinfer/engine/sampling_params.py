"""SamplingParams: how one request samples and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepinfer.errors import UserError

if TYPE_CHECKING:
    from deepinfer.engine.structured_params import StructuredOutputsParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1  # top_k's bound: the sampling op takes it as int32
MAX_LOGPROBS = 20  # logprobs / prompt_logprobs at most (vLLM's default max_logprobs)
MAX_N = 16384  # samples per request at most (vLLM's default VLLM_MAX_N_SEQUENCES)
MAX_LOGIT_BIAS = 100  # logit_bias values lie in [-100, 100] (OpenAI's range; larger ones overflow float32 logits to infinities)


class InvalidRequestError(UserError, ValueError):
    """A bad prompt or sampling parameter: a ValueError for the Python API, a one-line error for the
    CLI. param: the SamplingParams field to blame, where one is (the "param" of an OpenAI error)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def short_repr(value, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (a message quotes what it refuses, never a whole file)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class SamplingParams:
    """temperature 0 is greedy. top_k 0 or -1, top_p 1.0 and min_p 0.0 switch their filter off.
    top_k is at most 2**31 - 1 (the sampling op takes int32); one at or above the vocabulary size
    keeps every token, as off does.

    max_tokens: generated tokens at most (None: up to the model's maximum length).
    seed: the request's sampling seed; None derives one from LLM(seed=...) and the request's index,
    so runs repeat. Sampling is a function of (seed, position, logits) only: the same seed gives the
    same tokens whatever else is in the batch.
    stop: a string or a list of strings that end generation; the text is cut before the stop
    string (finish_reason "stop").
    stop_token_ids: a list of token ids that end generation (kept in token_ids, left out of the
    text, like EOS).
    ignore_eos: keep generating past EOS (benchmarks).
    n: samples of the prompt (vLLM's n; at most 16384, vLLM's default bound): the request's
    RequestOutput holds n CompletionOutputs, index 0..n-1, and finishes when all have. Sample 0
    samples with the request's seed (as with n=1), sample j > 0 with derive_seed(that seed, j):
    different samples at temperature > 0, the same ones on a rerun. The extra samples start once
    sample 0's prompt is in the KV cache and share its full blocks through the prefix cache
    (docs/architecture.md); with prefix caching off each computes the prompt itself. Not with
    speculative decoding; with expert parallelism the samples run on their request's rank.
    include_stop_str_in_output: keep the stop string that ended the text in it (and the text of
    an EOS or stop token id).

    What vLLM adds on top, applied to the model's float32 logits in this order before `sample`
    (temperature, top-k, top-p and min-p come after all of them):
    allowed_token_ids: only these tokens may be sampled (a non-empty list of token ids).
    bad_words: strings that must not be generated: each word is tokenized as it is and with a
    leading space (when that gives a distinct token sequence of the same length), and the last
    token of such a sequence is banned whenever the tokens generated just before match the rest of
    it (vLLM's rule; needs the model's tokenizer).
    min_tokens: EOS and stop_token_ids are banned until this many tokens were generated, and stop
    strings are not looked for before then (at most max_tokens).
    logit_bias: {token id: bias} added to those logits (values in [-100, 100], OpenAI's range).
    repetition_penalty (> 0, 1 = off): a token seen in the prompt or the output has its logit divided
    by it when positive, multiplied when not. frequency_penalty and presence_penalty (in [-2, 2],
    0 = off): subtracted from a logit, times the token's count in the output, and once if it occurs
    there at all (OpenAI's definitions; the prompt does not count).

    logprobs: None, or k in [0, 20]: each generated token's log-probability, its rank and the k most
    likely tokens (CompletionOutput.logprobs: one {token id: Logprob} per token, and
    cumulative_logprob). prompt_logprobs: the same for every prompt token but the first (None there);
    a request asking for them reads nothing from the prefix cache (every position is computed).
    Log-probabilities are those of the model's own distribution, log_softmax of its raw logits,
    before any of the processing above and before temperature (vLLM's default, raw_logprobs): they
    describe the model, not the filters, and are the same whatever a request's sampling settings.
    LLM(logprobs_mode="processed_logprobs") reports the distribution sampled from instead (after the
    processing and temperature, before top-k/top-p/min_p truncation).

    structured_outputs: a StructuredOutputsParams (or a dict of its fields): the output must match a
    JSON schema, a regex, a grammar or one of a list of choices (deepinfer.engine.structured_output);
    a token mask from the grammar comes before everything above, and the request finishes ("stop")
    when the grammar is complete. Needs llguidance (pip install 'deepinfer[structured]').
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        def bad(message: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams: {message}")

        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0, got {short_repr(self.temperature)}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {short_repr(self.top_p)}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise bad(f"top_k must be an integer in [1, {INT32_MAX}], or 0 / -1 to switch it off, got {short_repr(self.top_k)}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {short_repr(self.min_p)}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad(f"max_tokens must be an integer >= 1 (or None), got {short_repr(self.max_tokens)}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad(f"n must be an integer in [1, {MAX_N}], got {short_repr(self.n)}")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise bad(f"seed must be a 64-bit signed integer or None, got {short_repr(self.seed)}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be True or False, got {short_repr(getattr(self, name))}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(f"{name} must be in [-2, 2], got {short_repr(getattr(self, name))}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be a finite number > 0, got {short_repr(self.repetition_penalty)}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {short_repr(self.min_tokens)}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {short_repr(value)}")
        self.temperature, self.top_p, self.min_p = float(self.temperature), float(self.top_p), float(self.min_p)
        self.presence_penalty, self.frequency_penalty = float(self.presence_penalty), float(self.frequency_penalty)
        self.repetition_penalty = float(self.repetition_penalty)
        self.stop = self._strings(self.stop, bad)
        self.stop_token_ids = self._token_ids(self.stop_token_ids, bad)
        self.logit_bias = self._logit_bias(self.logit_bias, bad)
        self.bad_words = self._bad_words(self.bad_words, bad)
        self.allowed_token_ids = self._allowed(self.allowed_token_ids, bad)
        self.structured_outputs = self._structured(self.structured_outputs, bad)

    @staticmethod
    def _strings(stop, bad) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, (list, tuple)) else None
        if items is None or not all(isinstance(s, str) and s for s in items):
            raise bad(f"stop must be a non-empty string or a list of them, got {short_repr(stop)}")
        return items

    @staticmethod
    def _token_ids(ids, bad) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in ids):
            raise bad(f"stop_token_ids must be a list of token ids >= 0, got {short_repr(ids)}")
        return list(ids)

    @staticmethod
    def _logit_bias(bias, bad) -> dict[int, float]:
        if bias is None:
            return {}
        if not isinstance(bias, dict) or not all(_is_int(t) and 0 <= t <= INT64_MAX and _is_number(b) for t, b in bias.items()):
            raise bad(f"logit_bias must be a dict of token ids >= 0 to numbers in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {short_repr(bias)}")
        outside = next(((t, b) for t, b in bias.items() if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS), None)
        if outside is not None:
            raise bad(f"logit_bias values must lie in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}] (OpenAI's range), got {outside[1]!r} for token {outside[0]}; "
                      "to ban a token, use bad_words or allowed_token_ids")
        return {t: float(b) for t, b in bias.items()}

    @staticmethod
    def _bad_words(words, bad) -> list[str]:
        if words is None:
            return []
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
            raise bad(f"bad_words must be a list of non-blank strings, got {short_repr(words)}")
        return list(words)

    @staticmethod
    def _allowed(ids, bad) -> list[int] | None:
        if ids is None:
            return None
        if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in ids):
            raise bad(f"allowed_token_ids must be a non-empty list of token ids >= 0 (or None), got {short_repr(ids)}")
        return list(ids)

    @staticmethod
    def _structured(value, bad) -> StructuredOutputsParams | None:
        from deepinfer.engine.structured_params import StructuredOutputsParams

        if value is None or isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            raise bad(f"structured_outputs must be a StructuredOutputsParams or a dict of its fields, got {short_repr(value)}")
        unknown = sorted(set(value) - set(StructuredOutputsParams.__dataclass_fields__))
        if unknown:
            raise bad(f"structured_outputs has unknown field(s) {', '.join(map(repr, unknown))}")
        try:
            return StructuredOutputsParams(**value)
        except InvalidRequestError as exc:  # named by the field, so the server's 400 blames it ("param")
            raise bad(f"structured_outputs: {str(exc).removeprefix('StructuredOutputsParams: ')}") from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on: the request then needs its token history on the device."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether anything runs on the logits before `sample` (penalties, bias, bans, masks)."""
        return (
            self.penalized or bool(self.logit_bias) or bool(self.bad_words) or self.allowed_token_ids is not None or self.min_tokens > 0
            or self.structured_outputs is not None
        )  # fmt: skip
