"""`deepinfer run-batch -i requests.jsonl -o results.jsonl`: an OpenAI batch file in, OpenAI's batch
output format out, as vLLM's `run-batch` reads and writes them.

Each line of -i is one request to /v1/completions or /v1/chat/completions; each row of -o is that
request's Completion or ChatCompletion (or its error), in input order. A line that deepinfer cannot
honour gets an error row naming the field and the rest of the file runs. docs/usage.md describes it
all, with examples.

  deepinfer run-batch -i examples/requests.jsonl -o results.jsonl

Exit code: 0 when every line ran, 1 when any line got an error row, 2 for bad flags, files or input
lines (nothing runs), 130 when interrupted."""

from __future__ import annotations

import argparse
import json
import sys
import time

from deepinfer.cli.batch_requests import BatchRequest, Failure, read_batch_requests, sampling_params
from deepinfer.cli.batch_rows import BATCH_ROWS, WRITE_FAILED, error_row, result_row, row_text
from deepinfer.cli.engine_flags import add_engine_flags, check_engine_flags, load_llm, read_chat_template
from deepinfer.cli.flag_help import add_grouped_help
from deepinfer.cli.request_fields import describe as describe_fields
from deepinfer.cli.run import CLI_FIXES, Command, print_summary, run_command, to_stdout
from deepinfer.cli.run_output import InOrder, OutputFile, add_output_flags
from deepinfer.errors import UserError

__all__ = ["BATCH", "add_parser", "run_batch"]

INPUT_HELP = """the OpenAI batch file (-i); the line format and every request field
One request per line (deepinfer/cli/batch_requests.py):
  {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
   "body": {"model": ..., "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 64}}
  {"custom_id": "b", "method": "POST", "url": "/v1/completions",
   "body": {"prompt": "Hello, my name is", "max_tokens": 16, "temperature": 0, "stop": ["\\n"]}}
A completions "prompt" is a string, a list of token ids, or a list of either (a choice each); "n": N
gives N choices per prompt. Every other body field is honoured, ignored as vLLM ignores it ("user"),
or not implemented yet and accepted only at the value that switches it off ("stream": false, ...);
any other field or value fails that line, naming the field, and a field of one endpoint fails at the
other. "model" may be left out, null, or a name the run serves (--served-model-name, else --model as
given); any other gets vLLM's 404. Defaults are the endpoint's: max_tokens 16 for completions, none
but the model's length for chat (--max-model-len); unlike vLLM, generation_config.json does not
change them. A line without "seed" samples with one derived from --seed and its line number, so a
rerun repeats it. A line that breaks the file (not a JSON object, no "custom_id" string, a duplicate
custom_id) stops the run before it starts.
"""

OUTPUT_HELP = """OpenAI's batch output rows: one per line, in input order, to -o FILE (else stdout)
  {"id": ..., "custom_id": ..., "response": {"status_code": 200, "request_id": ..., "body": {a
   Completion or ChatCompletion: "id", "object", "created", "model", "choices", "usage"}}, "error": null}
or, for a line that fails alone, "response": {"status_code": 400 (404: unknown model), "body": null}
and "error": {"object": "error", "message", "type", "param" (the field to blame), "code"}. The file
is kept as `deepinfer run` keeps its output: never the input, locked for the run, an existing file
needs --resume (skip the custom_ids already there, error rows included) or --overwrite, one write
per row."""

def add_parser(sub) -> None:
    p = sub.add_parser(
        "run-batch",
        help="run an OpenAI batch file (vLLM's run-batch): JSONL requests in, OpenAI batch output rows out",
        description=__doc__.split("\n", 3)[3],
        usage="%(prog)s -i FILE [-o FILE] [--model PATH] [FLAG ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    add_grouped_help(p)
    inputs = p.add_argument_group("input", f"{INPUT_HELP}\n{describe_fields()}")
    inputs.add_argument("-i", "--input", required=True, metavar="FILE", help="the OpenAI batch input file (JSONL; format above)")
    inputs.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="the model names the requests may give (default: --model as given); the bodies carry the first")
    add_output_flags(p, "one OpenAI batch output row per line (a result or an error)", OUTPUT_HELP)
    add_engine_flags(p)
    p.set_defaults(func=run_batch)
    global _PARSER
    _PARSER = p


_PARSER: argparse.ArgumentParser | None = None


def run_batch(args) -> int:
    return run_command(args, BATCH)


def check_flags(args) -> None:
    check_engine_flags(args)
    for served in args.served_model_name or ():
        if not served.strip():
            raise UserError("--served-model-name: a name may not be empty")


def served_models(args) -> list[str]:
    """The model names requests may give: --served-model-name, else --model as given (vLLM's rule)."""
    from deepinfer.model.embedded_names import DEFAULT

    return list(args.served_model_name or [args.model or DEFAULT])


def request_ids(args) -> list[str]:
    return [json.dumps(r.custom_id) for r in read_batch_requests(args.input, served_models(args))]


def make_params(args, request: BatchRequest) -> list | None:
    """A SamplingParams per prompt (batch_requests.sampling_params), seeds derived from --seed and the line number."""
    return sampling_params(request, args.seed)


def engine_prompts(llm, request: BatchRequest, chat_template: str | None) -> list[dict]:
    """The engine's prompts for a request, a choice each: chat messages through the chat template
    (--chat-template's, else the tokenizer's, else the model's built-in format, with the body's
    options), as LLM.chat renders them."""
    if request.messages is not None:
        text = llm.render_conversation(request.messages, request.source, chat_template=chat_template, fixes=CLI_FIXES, **request.fields.chat)
        return [{"prompt": text}]
    return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in request.prompts]


def refuse(request: BatchRequest, exc) -> None:
    """Fail a request the engine refused (InvalidRequestError), blaming the body field behind the
    SamplingParams field the error names, if it names one."""
    param = exc.param
    request.fail(str(exc), request.fields.sources.get(param, param) if param is not None else None)


def generate_batch(args, ctx, output: OutputFile | None, done: set[str]) -> int:
    """Run every line not in `done`; write a row for each (rank 0), in input order. 1 when any failed."""
    first = ctx is None or ctx.rank == 0
    requests = read_batch_requests(args.input, served_models(args))
    skipped = 0
    if done:
        remaining = [r for r in requests if json.dumps(r.custom_id) not in done]
        skipped, requests = len(requests) - len(remaining), remaining
        if not requests:
            if first:
                print(f"deepinfer: nothing to do: all {skipped} requests are already in {args.output}", file=sys.stderr)
            return 0
    params = {i: make_params(args, r) for i, r in enumerate(requests) if r.failure is None}  # refused values fail their line before the model loads
    chat_template = read_chat_template(args.chat_template)
    llm = load_llm(args, ctx) if any(r.failure is None for r in requests) else None  # all refused: no model needed
    parts: list[tuple[int, int]] = []  # (request, choice) of each engine prompt
    inputs, part_params, names = [], [], []
    for i, request in enumerate(requests):
        if request.failure is not None:
            continue
        try:
            prompts = engine_prompts(llm, request, chat_template)
        except UserError as exc:
            request.fail(str(exc))
            continue
        for choice, prompt in enumerate(prompts):
            parts.append((i, choice))
            inputs.append(prompt)
            part_params.append(params[i][choice])
            names.append(request.source if len(prompts) == 1 else f"{request.source}, prompt {choice}")
    start = time.perf_counter()
    stream = iter(())
    if llm is not None and inputs:

        # Every prompt is checked (tokenized, its length against the model) before anything runs.
        stream = llm.generate_iter(
            inputs, part_params, use_tqdm=not args.no_progress, names=names, on_invalid=lambda k, exc: refuse(requests[parts[k][0]], exc),
        )  # fmt: skip
    choices: dict[int, list] = {}
    counts = {"prompt": 0, "generated": 0, "failed": 0}
    model = served_models(args)[0]

    def emit(index: int, item) -> None:
        request = requests[index]
        if isinstance(item, Failure):
            row = error_row(request, item)
        else:
            row = result_row(request, item, model)
            if row["error"] is None:  # (an error row: the request's grammar failed)
                counts["prompt"] += row["response"]["body"]["usage"]["prompt_tokens"]
                counts["generated"] += row["response"]["body"]["usage"]["completion_tokens"]
        try:
            line = row_text(row)
        except UnicodeEncodeError as exc:  # a result that is not valid Unicode: its own error row, the run goes on
            row = error_row(request, Failure(f"{request.source}: its result cannot be written as UTF-8 ({exc.reason})", None, WRITE_FAILED))
            line = row_text(row)
        counts["failed"] += row["error"] is not None
        if output is None:
            to_stdout(line)
        else:
            output.write(line)  # one write per row: a killed run leaves whole rows

    rows = InOrder(emit)  # rows go out in input order, with one process or several
    try:
        if first:
            if output is not None:
                output.begin(overwrite=args.overwrite)
            for index, request in enumerate(requests):
                if request.failure is not None:
                    rows.put(index, request.failure)
        for k, result in stream:
            index, choice = parts[k]
            if requests[index].failure is not None:  # another of its prompts was refused: its error row is out
                continue
            got = choices.setdefault(index, [None] * len(params[index]))
            got[choice] = result
            if all(o is not None for o in got):
                rows.put(index, choices.pop(index))
    finally:
        if llm is not None and inputs:
            stream.close()
    if first:
        print_summary(llm, len(requests), skipped, counts, time.perf_counter() - start, args.output, builtin=False)
    return 1 if counts["failed"] else 0


BATCH = Command("run-batch", BATCH_ROWS, check_flags, request_ids, generate_batch, lambda: _PARSER)
