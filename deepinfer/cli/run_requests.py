"""The requests of `deepinfer run`: JSONL lines, --prompt texts or the built-in prompts, and what a
line may hold.

A line is `{"prompt": str | "messages": [...] | "prompt_token_ids": [int, ...], "id": ...,
sampling keys}` or an OpenAI batch line `{"custom_id": ..., "method": "POST", "url":
"/v1/chat/completions" | "/v1/completions", "body": {the same keys but "id"}}`.

Two kinds of defect:
- the file's: a line that is not a JSON object, a batch line without "custom_id", an id that is not
  a string or an integer, two lines with one id. Nothing can name such a line in the output (ids
  are how --resume knows what is done), so the whole run is refused before it starts (exit 2).
- a request's: anything else (an unknown or unsupported field, a bad value, text that is not valid
  Unicode, a prompt too long for the model). That line alone fails: it gets an error row in the
  output and the rest of the file runs.

Every key is accounted for: besides the prompt ("prompt", "messages" or "prompt_token_ids") and
"id", a key is read by the table of deepinfer/cli/request_fields.py (the one `run-batch` reads too):
sampling fields map onto SamplingParams, the chat template's options apply to "messages", ignored
fields change nothing generated, fields deepinfer does not implement are accepted only at the value
that switches them off; any other key fails the line, naming it. A field's endpoint is not checked
here: `run` reads every field on every line ("model" is ignored: the run's model is --model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.cli import json_input
from deepinfer.cli.request_fields import BadField, name, read_fields, short
from deepinfer.errors import UserError

BUILTIN_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
    "def fibonacci(n):",
]

PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
BATCH_LINE_KEYS = ("custom_id", "method", "url", "body")
BATCH_URLS = ("/v1/chat/completions", "/v1/completions")
JSON_WHITESPACE = " \t\r"  # what a blank line may hold (JSON's whitespace; "\n" ends the line)


@dataclass
class Request:
    """One prompt to run: where it came from, how it is named in the output and how it samples."""

    id: Any  # written back as "id" or "custom_id"
    id_key: str  # "id" | "custom_id"
    source: str  # for messages: "input.jsonl line 3", "--prompt 2", "built-in prompt 1"
    ordinal: int  # line number or position: the per-request seed derives from it, so --resume repeats
    prompt: str | None = None
    messages: list | None = None
    prompt_token_ids: list | None = None
    overrides: dict = field(default_factory=dict)
    chat_options: dict = field(default_factory=dict)  # render_chat's keywords for "messages"
    error: str | None = None  # why this request fails (it gets an error row); None: it runs

    def fail(self, problem: str) -> None:
        """Mark the request as failed (its first problem is the one reported)."""
        if self.error is None:
            self.error = f"{self.source}: {problem}"


def read_jsonl_requests(path: str) -> list[Request]:
    requests = [parse_line(line, f"{path} line {number}", number) for number, line in read_input_lines(path)]
    if not requests:
        raise UserError(f"input file {path} has no prompts")
    return requests


def read_input_lines(path: str) -> list[tuple[int, str]]:
    """The non-blank lines of a UTF-8 JSONL file with their line numbers; a UserError naming what
    keeps the file from being read."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"input file {path} not found" if not file.exists() else f"input {path} is not a file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"cannot read {path}: it is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    # Lines end at "\n" only (a "\r" before it is JSON whitespace): str.splitlines() would also split
    # at U+2028, U+0085 and the like, which JSON strings may hold as they are.
    return [(number, line) for number, line in enumerate(text.split("\n"), start=1) if line.strip(JSON_WHITESPACE)]


def json_object_line(line: str, where: str) -> dict:
    """One JSONL line's object; a UserError (a defect of the file) when it is not JSON (or JSON
    deepinfer cannot read: deepinfer.cli.json_input) or not an object."""
    try:
        item = json_input.parse(line)
    except json_input.NotJson as exc:
        raise UserError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(item, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(item).__name__}")
    return item


def parse_line(line: str, where: str, number: int) -> Request:
    """The request of one JSONL line; a UserError for a defect of the file (see the module docstring),
    `request.error` set for a defect of this request."""
    item = json_object_line(line, where)
    batch = "custom_id" in item or "body" in item
    if batch and "custom_id" not in item:
        raise UserError(f"{where}: an OpenAI batch line needs a \"custom_id\"")
    id_key = "custom_id" if batch else "id"
    request = Request(item[id_key] if batch else item.get("id", number), id_key, where, number)
    if not isinstance(request.id, (str, int)) or isinstance(request.id, bool):
        raise UserError(f"{where}: {id_key} must be a string or an integer, got {short(request.id)}")
    if json_input.too_deep(item):  # before anything walks it
        request.fail(f"the line {json_input.depth_problem()}")
        return request
    bad_text = unicode_problem(item)
    if bad_text is not None:
        request.fail(bad_text)
        return request
    if batch:
        source = _batch_body(item, request)
        if source is None:
            return request
    else:
        source = {k: v for k, v in item.items() if k != "id"}
    _read_body(source, request, in_body=batch)
    return request


def _batch_body(item: dict, request: Request) -> dict | None:
    """The body of an OpenAI batch line, or None (request failed) when the line is not one deepinfer runs."""
    extra = [k for k in item if k not in BATCH_LINE_KEYS]
    if extra:
        request.fail(f"unknown field {name(extra[0])} in an OpenAI batch line (it holds {', '.join(BATCH_LINE_KEYS)})")
    elif item.get("method", "POST") != "POST":
        request.fail(f"method {short(item['method'])} is not supported; batch lines are POST requests")
    elif item.get("url", BATCH_URLS[0]) not in BATCH_URLS:
        request.fail(f"url {short(item['url'])} is not supported; deepinfer runs {' and '.join(BATCH_URLS)}")
    elif not isinstance(item.get("body"), dict):
        request.fail("an OpenAI batch line needs a \"body\" object")
    return item["body"] if request.error is None else None


def _read_body(source: dict, request: Request, in_body: bool) -> None:
    """Fill `request` from the keys of a line (or a batch line's body), failing it on the first bad key."""
    where = " in \"body\"" if in_body else ""
    given = [k for k in PROMPT_KEYS if k in source]
    try:
        fields, problem = read_fields(source, skip=PROMPT_KEYS, where=where), None
    except BadField as exc:
        fields, problem = None, str(exc)
    if not given:
        request.fail(f"no \"prompt\", \"messages\" or \"prompt_token_ids\"{where}" + (f" ({problem})" if problem else ""))
        return
    if problem:
        request.fail(problem)
        return
    if len(given) > 1:
        request.fail(f"give one of {', '.join(name(k) for k in given)}, not several")
        return
    key, value = given[0], source[given[0]]
    if key == "messages":
        if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        ):
            request.fail("\"messages\" must be a non-empty list of {\"role\": str, \"content\": str}")
            return
        request.messages = value
    elif fields.chat:
        request.fail(f"{name(next(iter(fields.chat)))} applies to \"messages\" only")
        return
    elif key == "prompt_token_ids":
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            request.fail("\"prompt_token_ids\" must be a list of integers")
            return
        request.prompt_token_ids = value
    else:
        if not isinstance(value, str):
            request.fail(f"\"prompt\" must be a string, got {type(value).__name__}")
            return
        request.prompt = value
    request.overrides = fields.sampling
    request.chat_options = fields.chat


def unicode_problem(item, root: str = "the line") -> str | None:
    """Why a parsed line (`root`: what the message calls it) is not valid Unicode text (a string in
    it holds a lone surrogate); None when it is."""
    bad = lone_surrogate(item, root=root)
    return None if bad is None else surrogate_message(bad)


def surrogate_message(path: str) -> str:
    shown = path.encode("ascii", "backslashreplace").decode()
    return f"{shown} holds a lone surrogate, which is not valid Unicode text (an escape such as \\udc00 without its pair)"


def lone_surrogate(value, path: str = "", root: str = "the line") -> str | None:
    """Where in a parsed JSON value a string holds a lone surrogate (it cannot be encoded as UTF-8):
    a path such as `body.messages[0].content` (`root` for the value itself); None when there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or root
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else key
            found = lone_surrogate(key, f"a key in {path or root}") or lone_surrogate(item, inner)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate(item, f"{path}[{i}]")
            if found:
                return found
    return None


def collect_requests(args) -> tuple[list[Request], bool]:
    """The requests, and whether they are the built-in demo prompts."""
    if args.prompt and args.input:
        raise UserError("give prompts either with --prompt or with -i/--input, not both")
    if args.input:
        requests = read_jsonl_requests(args.input)
    elif args.prompt:
        requests = []
        for n, text in enumerate(args.prompt, start=1):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # undecodable bytes on the command line
                raise UserError(f"--prompt {n} is not valid UTF-8 text (at character {exc.start})") from None
            requests.append(Request(n, "id", f"--prompt {n}", n, prompt=text))
    else:
        return [Request(n, "id", f"built-in prompt {n}", n, prompt=text) for n, text in enumerate(BUILTIN_PROMPTS, start=1)], True
    refuse_duplicate_ids(requests)
    return requests, False


def refuse_duplicate_ids(requests) -> None:
    """A UserError naming the first request whose id an earlier one has (ids are how the output
    and --resume tell requests apart)."""
    seen: dict[str, str] = {}
    for request in requests:
        key = json.dumps(request.id)
        if key in seen:
            raise UserError(f"{request.source}: duplicate {request.id_key} {short(request.id)} (first at {seen[key]})")
        seen[key] = request.source


def flag_params(args) -> dict:
    """The sampling values the flags give every request (a line's keys override them)."""
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        structured_outputs=args.structured_outputs,  # --json-schema, --regex, --choice, --grammar (deepinfer.cli.structured_flags)
    )


FLAGS = {
    "max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p", "stop": "--stop",
    "logprobs": "--logprobs", "prompt_logprobs": "--prompt-logprobs",
}  # fmt: skip


def check_flag_params(args) -> None:
    """A UserError naming the flag whose sampling value no request could run with."""
    from deepinfer.engine.sampling_params import SamplingParams

    try:
        SamplingParams(**flag_params(args))
    except ValueError as exc:
        text = str(exc).removeprefix("SamplingParams: ")
        flag = next((f for param, f in FLAGS.items() if text.startswith(param)), "a sampling flag")
        raise UserError(f"{flag}: {text}") from None


def make_params(args, request: Request):
    """The request's SamplingParams (flags, then its own keys); None, with request.error set, when
    its values are refused."""
    from deepinfer.engine.llm_engine import derive_seed
    from deepinfer.engine.sampling_params import SamplingParams

    values = flag_params(args)
    values["seed"] = derive_seed(args.seed, request.ordinal)  # per request, not per batch: a resumed run repeats
    values.update(request.overrides)
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        request.fail(str(exc).removeprefix("SamplingParams: "))
        return None
