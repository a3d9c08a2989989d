"""OpenAI's wire shapes as the server writes them: errors, streamed chunks, server-sent events.

A whole (non-streamed) answer is run-batch's body (deepinfer.cli.batch_rows.response_body): one
writer of OpenAI's Completion and ChatCompletion for both.

Errors: {"error": {"message", "type", "param", "code"}}, OpenAI's shape (vLLM's since 0.10), with
vLLM's type names per status and the status as the code; the openai client raises its error class
of the status (BadRequestError for 400, AuthenticationError 401, NotFoundError 404,
RateLimitError 429, InternalServerError 5xx).

Streaming: server-sent events, each `data: <JSON>\\n\\n`, the last `data: [DONE]\\n\\n`. A chunk is
a "text_completion" (completions) or a "chat.completion.chunk" (chat) holding the choices that got
text or finished in one engine step; a chat choice's first chunk carries {"role": "assistant"}.
With "stream_options": {"include_usage": true} a last chunk with no choices carries the usage. A
request aborted after its stream began (the request timeout, the server shutting down) ends with
an error event, `data: {"error": {...}}`, then [DONE]: the client sees why, not a torn stream. So
does a request that failed while running (its grammar, or token options that left nothing to
sample); the failed sample's last tokens are not sent.

Text deltas: a choice's text is decoded from all its tokens after each step; what is sent is that
text less (a) a trailing U+FFFD (a character whose bytes are split across tokens) and (b) the last
len(longest stop string) - 1 characters while a stop string may still complete there, so that what
was sent is always a prefix of the final text, which the last chunk completes.
"""

from __future__ import annotations

import json
import time

from deepinfer.cli.batch_rows import chat_logprobs, completion_logprobs
from deepinfer.cli.request_fields import COMPLETIONS
from deepinfer.engine.outputs import CompletionOutput

ERROR_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 408: "TimeoutError", 413: "RequestTooLargeError", 429: "RateLimitError",
    500: "InternalServerError", 503: "ServiceUnavailableError",
}  # fmt: skip


class ApiError(Exception):
    """An answer with an error status: one line of message, and the field to blame when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error object. Text a client sent may be quoted in it: a lone surrogate there is
    written as its escape (\\udc00), so that the answer can be encoded as UTF-8."""
    return {"error": {"message": utf8_safe(message), "type": ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError"),
                      "param": utf8_safe(param) if param is not None else None, "code": status}}  # fmt: skip


def utf8_safe(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def sse(item) -> str:
    """One server-sent event of a JSON value (or the literal [DONE])."""
    return f"data: {item if isinstance(item, str) else json.dumps(item, ensure_ascii=False)}\n\n"


DONE = sse("[DONE]")


class ChoiceText:
    """One streamed choice: its tokens so far and the text already sent (see the module docstring)."""

    def __init__(self, tokenizer, params):
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.sent = ""
        self.hold = max((len(s) for s in params.stop), default=1) - 1 if params.stop else 0
        self.started = False  # a chat choice's first chunk names the role

    def add(self, token_ids: list[int], final: CompletionOutput | None) -> str:
        """The new text for `token_ids` (the whole rest of the text when `final` is the choice's end)."""
        self.token_ids += token_ids
        if final is not None:
            text = final.text
            if not text.startswith(self.sent):  # cannot happen by the rule above; say so rather than send a wrong text
                raise RuntimeError(f"streamed text {self.sent!r} is not a prefix of the final text {text!r}")
        else:
            text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.params.skip_special_tokens) if self.tokenizer is not None else ""
            text = text.rstrip("\ufffd")
            if self.hold:
                text = text[: max(0, len(text) - self.hold)]
            if len(text) <= len(self.sent) or not text.startswith(self.sent):
                return ""
        delta = text[len(self.sent) :]
        self.sent = text
        return delta


class StreamWriter:
    """The chunks of one streamed request: choice c = prompt p * n + sample j, as the whole answer numbers them."""

    def __init__(self, url: str, model: str, hex_id: str, tokenizer, params: list, logprobs_k: int | None):
        self.completions = url == COMPLETIONS
        self.model = model
        self.id = f"{'cmpl' if self.completions else 'chatcmpl'}-{hex_id}"
        self.created = int(time.time())
        self.n = params[0].n
        self.logprobs_k = logprobs_k
        self.choices = {(p, j): ChoiceText(tokenizer, prm) for p, prm in enumerate(params) for j in range(prm.n)}
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def chunk(self, deltas) -> dict | None:
        """The chunk of one update's deltas (None when it holds nothing to send)."""
        choices = []
        for d in deltas:
            if d.final is not None and d.final.error is not None:  # it failed: the request's error event follows (its last draw meant nothing)
                continue
            state = self.choices[(d.prompt, d.index)]
            offset = len(state.sent)
            text = state.add(d.token_ids, d.final)
            self.completion_tokens += len(d.token_ids)
            finish = d.final.finish_reason if d.final is not None else None
            if not text and finish is None and not d.token_ids:
                continue
            logprobs = None
            if self.logprobs_k is not None and d.logprobs:
                piece = CompletionOutput(d.index, text, d.token_ids, None, logprobs=d.logprobs)
                logprobs = completion_logprobs(piece, self.logprobs_k, offset) if self.completions else chat_logprobs(piece, self.logprobs_k)
            choice = {"index": d.prompt * self.n + d.index}
            if self.completions:
                choice["text"] = text
            else:
                choice["delta"] = {"content": text} if state.started else {"role": "assistant", "content": text}
                state.started = True
            choice.update(logprobs=logprobs, finish_reason=finish, stop_reason=d.final.stop_reason if d.final is not None else None)
            choices.append(choice)
        if not choices:
            return None
        return self._envelope(choices)

    def usage_chunk(self, cached_tokens: int) -> dict:
        """The last chunk with stream_options.include_usage; cached_tokens: the prompt tokens taken from the prefix cache or a KV tier."""
        total = self.prompt_tokens + self.completion_tokens
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total,
                 "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip
        return {**self._envelope([]), "usage": usage}

    def _envelope(self, choices: list) -> dict:
        return {"id": self.id, "object": "text_completion" if self.completions else "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices}  # fmt: skip
