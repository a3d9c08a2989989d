"""The rows `deepinfer run-batch` writes: OpenAI's batch output format, as vLLM's run-batch writes it.

A result:
  {"id": "deepinfer-<hex>", "custom_id": ..., "response": {"status_code": 200, "request_id":
   "deepinfer-batch-<hex>", "body": <a Completion or a ChatCompletion>}, "error": null}
The body is what the endpoint answers: {"id": "cmpl-<hex>" | "chatcmpl-<hex>", "object":
"text_completion" | "chat.completion", "created", "model", "choices": [{"index", "text" |
"message": {"role": "assistant", "content"}, "logprobs", "finish_reason": "stop" | "length",
"stop_reason"}], "usage": {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details":
{"cached_tokens"}}}: cached_tokens are the prompt tokens taken from the prefix cache or a KV tier. It validates as
openai.types.Completion / openai.types.chat.ChatCompletion. "model" is the first served name;
"stop_reason" (the stop string or token id that ended the choice, null for EOS or length) is vLLM's
addition. A body with "n" has n choices per prompt; a completions body with several prompts has a
prompt's n choices after the previous prompt's (choice i*n + j: prompt i, sample j, as vLLM numbers
them). Usage counts each prompt's tokens once and every choice's tokens. "logprobs" is null unless
asked for (completions: "logprobs": k; chat: "logprobs": true, "top_logprobs": k): then OpenAI's
shape of each endpoint, from the model's raw distribution (SamplingParams.logprobs: vLLM's default),
each token's text as the tokenizer decodes it alone.

An error:
  {"id": ..., "custom_id": ..., "response": {"status_code": 400 | 404 | 500, "request_id": ...,
   "body": null}, "error": {"object": "error", "message": ..., "type": "BadRequestError" |
   "NotFoundError" | "InternalServerError", "param": the field to blame or null, "code": the status}}
vLLM's error response, kept flat (vLLM 0.10 and later nest it one level deeper, under "error"), so
that `row["error"]["message"]` and `["code"]` read as OpenAI's batch errors do. 400: the request
cannot run as written; 404: it names a model the run does not serve (vLLM's answer); 500: its
result could not be written (text that is not valid Unicode).

Results are written with their text as is (UTF-8); error rows in JSON's ASCII form, so that a
custom_id that is not valid Unicode text is written back as the input spelled it.
"""

from __future__ import annotations

import json
import time
import uuid

from deepinfer.cli.batch_requests import BatchRequest, Failure
from deepinfer.cli.request_fields import COMPLETIONS
from deepinfer.cli.run_output import RowFormat, json_logprob

ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}  # vLLM's names for the statuses
WRITE_FAILED = 500


def result_row(request: BatchRequest, outputs: list, model: str) -> dict:
    """The row of a request whose every prompt finished (`outputs`: a RequestOutput per prompt, each
    with n samples): a choice per sample, numbered over all of them. A request that failed while
    running (its structured-output grammar did not compile, its token options left no token to
    sample) is an error row (400, the field `failed_param` blames)."""
    failed = next((c.error for output in outputs for c in output.outputs if c.error is not None), None)
    if failed is not None:
        return error_row(request, Failure(f"{request.source}: {failed}", failed_param(request)))
    hex_id = uuid.uuid4().hex
    return _row(request, {"status_code": 200, "request_id": f"deepinfer-batch-{hex_id}", "body": response_body(request, outputs, model, hex_id)}, None)


def failed_param(request: BatchRequest) -> str | None:
    """The field to blame for a request that failed while running: its grammar (structured output),
    else none alone (its token options left nothing to sample: the message names them)."""
    return "structured_outputs" if request.fields.sampling.get("structured_outputs") is not None else None


def response_body(request: BatchRequest, outputs: list, model: str, hex_id: str) -> dict:
    """The endpoint's answer (a Completion or a ChatCompletion) to a request whose every prompt
    finished: what run-batch's rows carry and what `deepinfer serve` answers."""
    completions = request.url == COMPLETIONS
    choices = []
    for completion in (c for output in outputs for c in output.outputs):  # a prompt's n samples in a row, as vLLM numbers them
        choice = {"index": len(choices)}
        if completions:
            choice["text"] = completion.text
        else:
            choice["message"] = {"role": "assistant", "content": completion.text}
        logprobs = None
        if completion.logprobs is not None:
            logprobs = (completion_logprobs if completions else chat_logprobs)(completion, request.fields.sampling["logprobs"])
        choice.update(logprobs=logprobs, finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)
        choices.append(choice)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)  # once per prompt, whatever its n
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "id": f"{'cmpl' if completions else 'chatcmpl'}-{hex_id}",
        "object": "text_completion" if completions else "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            # OpenAI's field: the prompt tokens taken from the prefix cache or a KV tier, not computed
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)},
        },
    }


def _top(position: dict, k: int) -> list[tuple[str, float]]:
    """A position's k most likely tokens, by rank: (text, logprob as JSON writes it)."""
    ranked = sorted((lp.rank, lp.decoded_token or "", json_logprob(lp.logprob)) for lp in position.values() if lp.rank is not None and lp.rank <= k)
    return [(text, logprob) for _, text, logprob in ranked]


def completion_logprobs(completion, k: int, offset: int = 0) -> dict:
    """OpenAI's Completion choice logprobs: each generated token's text, logprob, offset in the
    text (from `offset`: a streamed chunk's tokens follow the text sent before), and its position's
    k most likely tokens {text: logprob}."""
    tokens, offsets = [], []
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        text = position[token_id].decoded_token or ""
        tokens.append(text), offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [json_logprob(position[t].logprob) for t, position in zip(completion.token_ids, completion.logprobs)],
        "top_logprobs": [dict(_top(position, k)) for position in completion.logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(completion, k: int) -> dict:
    """OpenAI's ChatCompletion choice logprobs: per generated token its text, logprob and UTF-8
    bytes, and its position's k most likely tokens (top_logprobs)."""

    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        chosen = position[token_id]
        content.append({**entry(chosen.decoded_token or "", chosen.logprob), "top_logprobs": [entry(t, lp) for t, lp in _top(position, k)]})
    return {"content": content, "refusal": None}


def error_row(request: BatchRequest, failure: Failure) -> dict:
    error = {"object": "error", "message": failure.message, "type": ERROR_TYPES[failure.status], "param": failure.param, "code": failure.status}
    return _row(request, {"status_code": failure.status, "request_id": f"deepinfer-batch-{uuid.uuid4().hex}", "body": None}, error)


def _row(request: BatchRequest, response: dict, error: dict | None) -> dict:
    return {"id": f"deepinfer-{uuid.uuid4().hex}", "custom_id": request.custom_id, "response": response, "error": error}


def row_text(row: dict) -> str:
    """The row as one line of JSON (no newline): results readable (non-ASCII as is), error rows
    ASCII. Raises UnicodeEncodeError for a result that is not valid Unicode."""
    if row["error"] is not None:
        return json.dumps(row, ensure_ascii=True)
    text = json.dumps(row, ensure_ascii=False)
    text.encode("utf-8")
    return text


def is_batch_row(item) -> bool:
    """A row of run-batch's output (parsed): the four keys, a string id and custom_id."""
    if not isinstance(item, dict) or set(item) != {"id", "custom_id", "response", "error"}:
        return False
    return isinstance(item["id"], str) and isinstance(item["custom_id"], str)


BATCH_ROWS = RowFormat("an OpenAI batch output row of deepinfer run-batch", is_batch_row, lambda item: item["custom_id"], ('{"id": ',), (', "custom_id": ',))
