"""What deepinfer does with each field of a request body: the one table that `deepinfer run` (its
JSONL lines, OpenAI batch lines included) and `deepinfer run-batch` read.

Every field a body may hold besides its prompt is in FIELDS, under one rule:
- Sampling(param): the value becomes SamplingParams.<param>; null leaves the default (vLLM's
  reading), except where the rule keeps it (max_tokens null: no limit but the model's length).
  `run_values`: `run` accepts only these (and null), where its rows cannot hold what the field asks
  (n: a `run` row holds one output; run-batch writes n choices); `batch_hint`: run-batch accepts
  only null, where an OpenAI body has no place for the result (prompt_logprobs: `run` rows hold them);
- Chat(option): how the chat template renders "messages" (render_chat's argument of that name);
- Ignored(why): accepted and ignored, as vLLM ignores it: it changes nothing that is generated;
- Off(values): an OpenAI / vLLM feature deepinfer does not implement yet, accepted only at a value
  that switches it off (null too; clients often send the defaults). Any other value fails the line,
  naming the field;
- Model(): the model the request names (`run` ignores it; `run-batch` checks it, as vLLM does).
A field not in FIELDS fails its line as unknown. vLLM would log a warning and drop it; deepinfer
never runs a request with part of it silently dropped.

Enabling a field deepinfer learns is one line here: once SamplingParams implements
presence_penalty, its rule becomes Sampling("presence_penalty").

`only` ties a field to one endpoint, as vLLM's request types do (top_logprobs and the chat
template's options belong to /v1/chat/completions, suffix and best_of to /v1/completions). `run-batch`
refuses a field at the other endpoint; `run` reads every field on every line.
"""

from __future__ import annotations

import difflib
import json
import textwrap
from dataclasses import dataclass, field
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
CLI_LISTING = "`--help` lists the fields it reads"  # where a command-line user finds the fields


@dataclass(frozen=True)
class Sampling:
    param: str  # SamplingParams' field
    keep_null: bool = False  # null is a value (passed on), not "the default"
    only: str | None = None
    run_values: tuple | None = None  # the only values `run` takes (None: any)
    run_hint: str = ""  # why `run` takes no other, and what to do instead
    convert: Any = None  # JSON's spelling -> SamplingParams' (None: as it is)
    batch_hint: str = ""  # set: run-batch takes only null; why, and what to do instead


@dataclass(frozen=True)
class Chat:
    option: str  # render_chat's keyword argument
    kind: type  # the JSON type the value must have (bool, dict)
    only: str | None = None


@dataclass(frozen=True)
class Ignored:
    why: str
    only: str | None = None


@dataclass(frozen=True)
class Off:
    values: tuple  # the values that switch it off (null always does)
    only: str | None = None
    hint: str = ""  # what to do instead, if there is something


@dataclass(frozen=True)
class Logprobs:
    """OpenAI's logprobs: on /v1/completions an int k (the top k per token, null: none); on
    /v1/chat/completions a bool, with "top_logprobs" k beside it. Both become SamplingParams.logprobs
    = k. `deepinfer run` reads either spelling on any line (true or "top_logprobs": chat's; an int:
    completions')."""

    only: str | None = None


@dataclass(frozen=True)
class Model:
    only: str | None = None


FIELDS: dict[str, Sampling | Chat | Ignored | Off | Logprobs | Model] = {
    "model": Model(),
    # Sampling: OpenAI's names; top_k, min_p, stop_token_ids, ignore_eos, skip_special_tokens are vLLM's.
    # max_completion_tokens is OpenAI's newer name; listed after max_tokens, it wins when both are set (vLLM).
    "max_tokens": Sampling("max_tokens", keep_null=True),
    "max_completion_tokens": Sampling("max_tokens"),
    "temperature": Sampling("temperature"),
    "top_p": Sampling("top_p"),
    "top_k": Sampling("top_k"),
    "min_p": Sampling("min_p"),
    "seed": Sampling("seed"),
    "stop": Sampling("stop"),
    "stop_token_ids": Sampling("stop_token_ids"),
    "ignore_eos": Sampling("ignore_eos"),
    "skip_special_tokens": Sampling("skip_special_tokens"),
    "n": Sampling("n", run_values=(1,), run_hint="a `deepinfer run` row holds one output; deepinfer run-batch writes n choices"),
    # Logits processing (SamplingParams); repetition_penalty, min_tokens, bad_words, allowed_token_ids and
    # include_stop_str_in_output are vLLM's. logit_bias comes as OpenAI writes it: {"token id": bias}.
    "presence_penalty": Sampling("presence_penalty"),
    "frequency_penalty": Sampling("frequency_penalty"),
    "repetition_penalty": Sampling("repetition_penalty"),
    "min_tokens": Sampling("min_tokens"),
    "logit_bias": Sampling("logit_bias", convert=lambda bias: token_keys(bias) if isinstance(bias, dict) else bias),
    "allowed_token_ids": Sampling("allowed_token_ids"),
    "bad_words": Sampling("bad_words"),
    "include_stop_str_in_output": Sampling("include_stop_str_in_output"),
    # The chat template's options (vLLM's extra chat parameters).
    "add_generation_prompt": Chat("add_generation_prompt", bool, only=CHAT),
    "continue_final_message": Chat("continue_final_message", bool, only=CHAT),
    "chat_template_kwargs": Chat("chat_template_kwargs", dict, only=CHAT),
    # Accepted and ignored, as vLLM does.
    "user": Ignored("an end-user tag for a server's abuse monitoring"),
    "request_id": Ignored("a name for the request in a server's logs; the output's ids are deepinfer's own"),
    "parallel_tool_calls": Ignored("it only matters with tools", only=CHAT),
    # Not implemented yet: accepted only where they are switched off.
    "best_of": Off((1,), only=COMPLETIONS),
    "stream": Off((False,), hint="the results go to the output file"),
    "stream_options": Off(()),
    "echo": Off((False,)),
    "suffix": Off((), only=COMPLETIONS),
    "logprobs": Logprobs(),
    "top_logprobs": Logprobs(only=CHAT),
    "prompt_logprobs": Sampling("prompt_logprobs", batch_hint="an OpenAI batch body has no place for them; deepinfer run writes them in its rows"),
    "spaces_between_special_tokens": Off((True,)),
    "truncate_prompt_tokens": Off(()),
    "use_beam_search": Off((False,)),
    "length_penalty": Off((1,)),
    # Structured output: vLLM's structured_outputs object, or OpenAI's response_format (text, json_object, json_schema).
    "response_format": Sampling("structured_outputs", convert=lambda value: structured_from_response_format(value)),
    "structured_outputs": Sampling("structured_outputs"),
    "tools": Off((), only=CHAT),
    "tool_choice": Off(("none",), only=CHAT),
    "reasoning_effort": Off((), only=CHAT, hint='DeepSeek\'s thinking and effort go in "chat_template_kwargs": '
                                                 '{"thinking": true}, for V4 also "reasoning_effort": "max"'),
    "chat_template": Off((), only=CHAT, hint="pass --chat-template"),
    "priority": Off((0,)),
    "cache_salt": Off(()),
}


class BadField(ValueError):
    """A field the line cannot run with; `param` names it (the "param" of an OpenAI error)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


@dataclass
class BodyFields:
    """What a body's fields ask for: SamplingParams keywords, render_chat keywords, the model named."""

    sampling: dict = field(default_factory=dict)
    chat: dict = field(default_factory=dict)
    model: Any = None
    sources: dict = field(default_factory=dict)  # SamplingParams keyword -> the body field that set it


def read_fields(body: dict, skip, endpoint: str | None = None, where: str = "", listed: str = CLI_LISTING) -> BodyFields:
    """The fields of `body` other than those in `skip` (its prompt), by FIELDS; BadField for the
    first field (in the body's order) that fails. `endpoint`: check `only` against it (run-batch).
    `where`: how a message places the fields (' in "body"'). `listed`: where the reader of an
    unknown field's message finds the fields (an HTTP client has no --help: "")."""
    for key, value in body.items():
        if key in skip:
            continue
        rule = FIELDS.get(key)
        if rule is None:
            close = difflib.get_close_matches(key, FIELDS, n=1) if len(key) < 100 else []
            guess = f"; did you mean {name(close[0])}?" if close else ""
            raise BadField(f"unknown field {name(key)}{where}; deepinfer does not implement it{guess}{f' ({listed})' if listed else ''}", key)
        if endpoint is not None and rule.only is not None and rule.only != endpoint:
            raise BadField(f"{name(key)} is a field of {rule.only} requests, not of {endpoint}", key)
        if isinstance(rule, Off) and value is not None and not any(same(value, v) for v in rule.values):
            off = f"leave it out or set it to {' or '.join(json.dumps(v) for v in (*rule.values, None))}"
            hint = f" ({rule.hint})" if rule.hint else ""
            raise BadField(f"{name(key)}: {short(value)} is not supported (deepinfer does not implement {key}){hint}; {off}", key)
        run_refuses = isinstance(rule, Sampling) and endpoint is None and rule.run_values is not None and value is not None
        if run_refuses and not any(same(value, v) for v in rule.run_values):
            off = " or ".join(json.dumps(v) for v in (*rule.run_values, None))
            raise BadField(f"{name(key)}: {short(value)} is not supported by deepinfer run ({rule.run_hint}); leave it out or set it to {off}", key)
        if isinstance(rule, Sampling) and endpoint is not None and rule.batch_hint and value is not None:
            raise BadField(f"{name(key)}: {short(value)} is not supported by deepinfer run-batch ({rule.batch_hint}); leave it out or set it to null", key)
        if isinstance(rule, Chat) and value is not None and not isinstance(value, rule.kind):
            kind = {bool: "true or false", dict: "a JSON object"}[rule.kind]
            raise BadField(f"{name(key)} must be {kind}, got {short(value)}", key)
    fields = BodyFields()
    for key, rule in FIELDS.items():  # the table's order: a later field wins (max_completion_tokens)
        if key not in body or key in skip:
            continue
        value = body[key]
        if isinstance(rule, Sampling) and (value is not None or rule.keep_null):
            fields.sampling[rule.param] = rule.convert(value) if rule.convert is not None else value
            fields.sources[rule.param] = key
        elif isinstance(rule, Chat) and value is not None:
            fields.chat[rule.option] = value
        elif isinstance(rule, Model):
            fields.model = value
    _read_logprobs(body, endpoint or _logprobs_spelling(body), fields)
    return fields


def _logprobs_spelling(body: dict) -> str:
    """Which endpoint's logprobs fields a `run` line (no endpoint) writes: chat's ("logprobs": true
    / false, or "top_logprobs"), else completions' ("logprobs": k)."""
    return CHAT if isinstance(body.get("logprobs"), bool) or body.get("top_logprobs") is not None else COMPLETIONS


def _read_logprobs(body: dict, endpoint: str, fields: BodyFields) -> None:
    """SamplingParams.logprobs from OpenAI's fields (see Logprobs); BadField for a wrong type."""
    wanted = body.get("logprobs")
    if endpoint == CHAT:
        top = body.get("top_logprobs")
        if wanted not in (None, True, False):
            raise BadField(f"{name('logprobs')} must be true or false on {CHAT}, got {short(wanted)}", "logprobs")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool)):
            raise BadField(f"{name('top_logprobs')} must be an integer, got {short(top)}", "top_logprobs")
        if top and not wanted:
            raise BadField(f"{name('top_logprobs')} needs \"logprobs\": true", "top_logprobs")
        if wanted:
            fields.sampling["logprobs"] = top or 0
            fields.sources["logprobs"] = "top_logprobs" if top else "logprobs"
    elif wanted is not None and wanted is not False:
        if not isinstance(wanted, int) or isinstance(wanted, bool):
            raise BadField(f"{name('logprobs')} must be an integer (the top tokens per position) on {COMPLETIONS}, got {short(wanted)}", "logprobs")
        fields.sampling["logprobs"] = wanted
        fields.sources["logprobs"] = "logprobs"


def structured_from_response_format(value):
    """OpenAI's response_format as SamplingParams.structured_outputs: {"type": "text"} none,
    {"type": "json_object"} any JSON object, {"type": "json_schema", "json_schema": {"schema": ...}} that schema."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    schema = value.get("json_schema") if kind == "json_schema" else None
    if isinstance(schema, dict) and "schema" in schema:
        return {"json": schema["schema"]}
    wanted = '{"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}'
    raise BadField(f"response_format must be {wanted}, got {short(value)}", "response_format")


def token_keys(bias: dict) -> dict:
    """OpenAI's logit_bias keys are token ids written as JSON strings: "42" -> 42. Other keys stay
    as they are, for SamplingParams to refuse with its message."""
    return {int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else k: v for k, v in bias.items()}


def describe() -> str:
    """The table as --help text: which fields run, which are ignored, which only switched off; and the bounds on a request."""
    from deepinfer.cli.json_input import MAX_DEPTH
    from deepinfer.engine.sampling_params import MAX_LOGIT_BIAS, MAX_N

    def listed(kind) -> str:
        return ", ".join(k for k, rule in FIELDS.items() if isinstance(rule, kind))

    off = ", ".join(f"{k} {' / '.join(json.dumps(v) for v in rule.values) or 'null'}" for k, rule in FIELDS.items() if isinstance(rule, Off))
    text = (
        f"Request fields (deepinfer/cli/request_fields.py): sampling: {listed(Sampling)} (n: run-batch only, run takes 1; "
        f"prompt_logprobs: run only); {listed(Logprobs)} (an int on completions, true with top_logprobs on chat; run reads either); "
        "the chat template's options: "
        f"{listed(Chat)}; ignored, as vLLM ignores them: {listed(Ignored)}; not implemented yet, accepted only at the value "
        f"that switches them off (or null): {off}. Any other field fails its line. Bounds: n <= {MAX_N} (vLLM's), logit_bias values "
        f"in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}] (OpenAI's), at most {MAX_DEPTH} levels of nested objects and arrays per line, and a "
        "text no longer than the model's maximum length times its tokenizer's longest token (checked before tokenizing)."
    )
    return textwrap.fill(text, width=100, break_on_hyphens=False)


def same(value, neutral) -> bool:
    """value equals the neutral value, type included for numbers (True is not 1, 0.0 is 0)."""
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    return type(value) is type(neutral) and value == neutral


def name(key: str) -> str:
    return json.dumps(key)  # quoted, and escaped if it holds odd characters


def short(value, limit: int = 60) -> str:
    """A parsed JSON value as JSON text, cut to `limit` characters."""
    try:
        text = json.dumps(value)
    except RecursionError:  # nested deeper than json.dumps goes: what it is will do
        return f"a deeply nested {'object' if isinstance(value, dict) else 'array'}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
