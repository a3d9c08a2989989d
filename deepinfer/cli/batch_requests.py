"""The requests of `deepinfer run-batch`: the lines of an OpenAI batch input file.

A line is `{"custom_id": str, "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body": {...}}`. A /v1/completions body holds "prompt": a string, a list of token ids, or a list of
either (one choice per prompt, as vLLM answers). A /v1/chat/completions body holds "messages":
[{"role": str, "content": str or a list of {"type": "text", "text": str} parts (joined by a
newline, as vLLM joins them)}, ...]; other keys of a message reach the chat template as they are.
The body's other fields are read by the table of deepinfer/cli/request_fields.py, at the line's
endpoint. "model" is checked as vLLM checks it: absent, null or one of the names the run serves
(--served-model-name, else --model as given); any other name fails the line with status 404.

Two kinds of defect, as for `deepinfer run`:
- the file's: a line that is not a JSON object, without a "custom_id" string, or with a custom_id an
  earlier line has. Nothing could name such a line in the output (custom_ids are how --resume knows
  what is done), so the whole run is refused before it starts (exit 2). vLLM stops on these too.
- a request's: anything else. That line gets an error row naming the problem (and, where one field
  is to blame, the field: the error's "param"), and the rest of the file runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.cli import json_input
from deepinfer.cli.request_fields import CHAT, CLI_LISTING, COMPLETIONS, BadField, BodyFields, name, read_fields, short
from deepinfer.cli.run_requests import json_object_line, read_input_lines, refuse_duplicate_ids, unicode_problem
from deepinfer.errors import UserError

LINE_KEYS = ("custom_id", "method", "url", "body")
DEFAULT_MAX_TOKENS = {COMPLETIONS: 16}  # vLLM's CompletionRequest default; a chat request has none (the model's length)
PROMPT_FIELD = {COMPLETIONS: "prompt", CHAT: "messages"}  # each endpoint's prompt; the other's is refused at it
NOT_FOUND = 404


@dataclass
class Failure:
    """Why a request gets an error row: a message, the field to blame, the HTTP status a server answers."""

    message: str
    param: str | None = None
    status: int = 400


@dataclass
class BatchRequest:
    """One line of the batch file: where it came from, its endpoint, its prompts and its fields."""

    custom_id: str
    source: str  # "in.jsonl line 3", for messages
    ordinal: int  # the line number: the per-request seeds derive from it, so --resume repeats
    url: str = ""
    prompts: list = field(default_factory=list)  # /v1/completions: each a str or a list of token ids, one choice each
    messages: list | None = None  # /v1/chat/completions
    fields: BodyFields | None = None
    failure: Failure | None = None

    id_key = "custom_id"  # how the output names the request (run_requests.refuse_duplicate_ids)

    @property
    def id(self) -> str:
        return self.custom_id

    def fail(self, message: str, param: str | None = None, status: int = 400) -> None:
        """Mark the request as failed (its first problem is the one reported), the message placed
        at its line unless it already is."""
        if self.failure is None:
            placed = message if message.startswith(self.source) else f"{self.source}: {message}"
            self.failure = Failure(placed, param, status)


def read_batch_requests(path: str, served_models: list[str]) -> list[BatchRequest]:
    """Every line of the batch file `path`; a UserError for a defect of the file (module docstring)."""
    requests = [parse_batch_line(line, f"{path} line {number}", number, served_models) for number, line in read_input_lines(path)]
    if not requests:
        raise UserError(f"input file {path} has no requests")
    refuse_duplicate_ids(requests)
    return requests


def parse_batch_line(line: str, where: str, number: int, served_models: list[str]) -> BatchRequest:
    """The request of one line; a UserError for a defect of the file, `request.failure` set for a
    defect of this request."""
    item = json_object_line(line, where)
    if "custom_id" not in item:
        raise UserError(f"{where}: an OpenAI batch line needs a \"custom_id\"")
    if not isinstance(item["custom_id"], str):
        raise UserError(f"{where}: custom_id must be a string, got {short(item['custom_id'])}")
    request = BatchRequest(item["custom_id"], where, number)
    if json_input.too_deep(item):  # before anything walks it
        request.fail(f"the line {json_input.depth_problem()}")
        return request
    problem = unicode_problem(item)
    if problem is not None:
        request.fail(problem)
        return request
    body = _body(item, request)
    if body is not None:
        read_body(body, request, served_models)
    return request


def _body(item: dict, request: BatchRequest) -> dict | None:
    """The body of a line whose method, url and body deepinfer runs; None (request failed) otherwise."""
    extra = [k for k in item if k not in LINE_KEYS]
    if extra:
        request.fail(f"unknown field {name(extra[0])} in an OpenAI batch line (it holds {', '.join(LINE_KEYS)})", extra[0])
    elif item.get("method") != "POST":
        got = f"method {short(item['method'])} is not supported" if "method" in item else "no \"method\""
        request.fail(f"{got}; batch lines are \"method\": \"POST\" requests", "method")
    elif item.get("url") not in PROMPT_FIELD:
        got = f"url {short(item['url'])} is not supported" if "url" in item else "no \"url\""
        request.fail(f"{got}; deepinfer runs {' and '.join(PROMPT_FIELD)}", "url")
    elif not isinstance(item.get("body"), dict):
        request.fail("an OpenAI batch line needs a \"body\" object", "body")
    else:
        request.url = item["url"]
        return item["body"]
    return None


def read_body(body: dict, request: BatchRequest, served_models: list[str], *, skip=(), where: str = " in \"body\"", listed: str = CLI_LISTING) -> None:
    """Fill `request` (its url set) from a request body, failing it on the first problem (in the
    body's order): the one check of a body that run-batch's lines and `deepinfer serve`'s requests
    share. `skip`: fields the caller reads itself (the server: "stream", "stream_options");
    `listed`: read_fields'."""
    prompt_field = PROMPT_FIELD[request.url]
    other = next(f for f in PROMPT_FIELD.values() if f != prompt_field)
    for key in body:
        if key == other:
            request.fail(f"{name(key)} is a field of {'/v1/chat/completions' if key == 'messages' else '/v1/completions'} requests, "
                         f"not of {request.url} (it reads {name(prompt_field)})", key)  # fmt: skip
            return
    try:
        request.fields = read_fields(body, skip=(prompt_field, *skip), endpoint=request.url, where=where, listed=listed)
    except BadField as exc:
        request.fail(str(exc), exc.param)
        return
    model = request.fields.model
    if model is not None and model not in served_models:
        if not isinstance(model, str):
            request.fail(f"\"model\" must be a string, got {short(model)}", "model")
        else:  # vLLM's answer to a model it does not serve
            request.fail(f"The model `{model}` does not exist; this run serves {', '.join(served_models)} (--served-model-name)", "model", NOT_FOUND)
        return
    if prompt_field not in body:
        request.fail(f"a {request.url} body needs {name(prompt_field)}", prompt_field)
    elif prompt_field == "prompt":
        request.prompts = _prompts(body["prompt"], request)
    else:
        request.messages = _messages(body["messages"], request)


def _prompts(value, request: BatchRequest) -> list:
    """The prompts of a completions body: a string, token ids, or a non-empty list of either."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(_is_token(t) for t in value):
            return [value]
        if all(isinstance(p, str) for p in value) or all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in value):
            return list(value)
    request.fail(
        f"\"prompt\" must be a string, a list of token ids (integers >= 0), or a non-empty list of strings or of token-id lists, got {short(value)}",
        "prompt",
    )
    return []


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _messages(value, request: BatchRequest) -> list | None:
    """The messages of a chat body, each content as one string (text parts joined by newlines)."""
    if not isinstance(value, list) or not value:
        request.fail(f"\"messages\" must be a non-empty list of messages, got {short(value)}", "messages")
        return None
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            request.fail(f"{where} must be an object with a \"role\" string, got {short(message)}", "messages")
            return None
        content = message.get("content")
        if isinstance(content, list):
            texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                bad = next(part for part in content if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)))
                kind = f"a {short(bad.get('type'))} part" if isinstance(bad, dict) else short(bad)
                request.fail(f"{where}.content holds {kind}; deepinfer reads text only: {{\"type\": \"text\", \"text\": str}} parts", "messages")
                return None
            content = "\n".join(texts)
        if not isinstance(content, str):
            request.fail(f"{where}.content must be a string or a list of text parts, got {short(content)}", "messages")
            return None
        messages.append({**message, "content": content})
    return messages


def sampling_params(request: BatchRequest, base_seed: int) -> list | None:
    """A SamplingParams per prompt of a read request (the endpoint's defaults, then the body's
    fields); None, with the request failed, when a value is refused. Without a "seed", prompt 0
    samples with derive_seed(base_seed, request.ordinal) and prompt j > 0 with one derived from that
    (with "n", the engine derives each sample's seed from its prompt's)."""
    from deepinfer.engine.llm_engine import derive_seed
    from deepinfer.engine.sampling_params import SamplingParams

    values = {"max_tokens": DEFAULT_MAX_TOKENS.get(request.url), **request.fields.sampling}
    line_seed = derive_seed(base_seed, request.ordinal)
    params = []
    for choice in range(max(1, len(request.prompts))):
        seed = values.get("seed", line_seed if choice == 0 else derive_seed(line_seed, choice))
        try:
            params.append(SamplingParams(**{**values, "seed": seed}))
        except ValueError as exc:
            text = str(exc).removeprefix("SamplingParams: ")
            param = next((p for p in request.fields.sources if text.startswith(p)), None)
            field = request.fields.sources.get(param)
            request.fail(text if field in (None, param) else f"{name(field)}: {text}", field)
            return None
    return params
