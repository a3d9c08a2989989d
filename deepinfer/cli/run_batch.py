"""`deepinfer run-batch -i requests.jsonl -o results.jsonl`: an OpenAI batch file in, OpenAI's batch
output format out, as vLLM's `run-batch` reads and writes them.

Input (-i FILE), one request per line (deepinfer/cli/batch_requests.py):
  {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
   "body": {"model": ..., "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 64}}
  {"custom_id": "b", "method": "POST", "url": "/v1/completions",
   "body": {"prompt": "Hello, my name is", "max_tokens": 16, "temperature": 0, "stop": ["\\n"]}}
  A completions "prompt" is a string, a list of token ids, or a list of either (a choice each;
  "n": N gives N choices per prompt, samples that share the prompt's KV blocks).
  The body's other fields are listed at the end of this help; every one is either honoured,
  ignored as vLLM ignores it ("user", "request_id"), or not implemented yet and accepted only at the
  value that switches it off ("echo": false, "stream": false, ...). Any other
  field, or another value, fails that line with an error row naming the field: a request never runs
  with part of it dropped. A field of one endpoint fails at the other (top_logprobs and the chat
  template's options are chat fields; suffix and best_of completions fields), as in vLLM.
  vLLM's run-batch reads /v1/chat/completions (and embeddings and scores, which deepinfer does not
  serve); deepinfer reads /v1/completions too, as OpenAI's Batch API does.

Model: "model" may be left out, null, or one of the names the run serves: --served-model-name
NAME..., else --model as given (default tiny-v3). Any other name fails the line with vLLM's answer,
status 404 "The model `x` does not exist". The bodies' "model" is the first served name.

Defaults are the endpoint's, as in vLLM: max_tokens 16 for /v1/completions, and for chat no limit
but the model's length (--max-model-len; such a line needs a KV cache that holds a whole sequence of
that length, else it fails: give it max_tokens, or lower --max-model-len); temperature 1, top_p 1.
Unlike vLLM, the checkpoint's generation_config.json does not change them. A line without "seed" samples with a seed derived from
--seed and its line number, so a rerun or --resume repeats it.

Output (-o FILE), one row per line, in input order (deepinfer/cli/batch_rows.py):
  {"id": ..., "custom_id": ..., "response": {"status_code": 200, "request_id": ..., "body": {a
   Completion or ChatCompletion: "id", "object", "created", "model", "choices", "usage"}}, "error": null}
or, for a line that fails alone, "response": {"status_code": 400 (404: unknown model), "body": null}
and "error": {"object": "error", "message", "type", "param" (the field to blame), "code"}.
Without -o the rows go to stdout.

The output file is kept as `deepinfer run` keeps it (deepinfer/cli/run_output.py): never the input,
locked for the run (a second run on it fails at once), an existing file needs --resume or
--overwrite, one write per row. --resume skips the custom_ids already in the output (error rows
count as done: delete them to retry those lines) and appends the rest, after dropping the torn last
row an interrupted run may leave. A line that breaks the file (not a JSON object, no "custom_id"
string, a duplicate custom_id) stops the run before it starts; vLLM stops on these too.

Exit code: 0 when every line ran, 1 when any line got an error row, 2 for bad flags, files or input
lines (nothing runs), 130 when interrupted.

The engine flags are `deepinfer run`'s (deepinfer/cli/engine_flags.py), --ep included: each rank
runs every N-th request and rank 0 writes the output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from deepinfer.cli.batch_requests import BatchRequest, Failure, read_batch_requests, sampling_params
from deepinfer.cli.batch_rows import BATCH_ROWS, WRITE_FAILED, error_row, result_row, row_text
from deepinfer.cli.engine_flags import add_engine_flags, check_engine_flags, load_llm, read_chat_template
from deepinfer.cli.request_fields import describe as describe_fields
from deepinfer.cli.run import CLI_FIXES, Command, print_summary, run_command, to_stdout
from deepinfer.cli.run_output import InOrder, OutputFile, add_output_flags
from deepinfer.errors import UserError

__all__ = ["BATCH", "add_parser", "run_batch"]

def add_parser(sub) -> None:
    p = sub.add_parser(
        "run-batch",
        help="run an OpenAI batch file (vLLM's run-batch): JSONL requests in, OpenAI batch output rows out",
        description=f"{__doc__}\n{describe_fields()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-i", "--input", required=True, metavar="FILE", help="the OpenAI batch input file (JSONL; format above)")
    add_output_flags(p, "one OpenAI batch output row per line (a result or an error)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model names the requests may give (default: --model as given); the bodies carry the first")
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
            inputs, part_params, use_tqdm=not args.no_progress, names=names, on_invalid=lambda k, exc: requests[parts[k][0]].fail(str(exc)),
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
