"""`deepinfer run`: offline generation for prompts from the command line or a JSONL file.

Generate text for prompts given with --prompt, or read from a JSONL file (-i, one request per line)
into a JSONL file (-o, one row per request, in input order). With no prompts at all it runs a few
built-in prompts on the embedded default model (tiny-v3: DeepSeek-V3's architecture, dummy weights).
docs/usage.md describes it all, with examples.

  deepinfer run --prompt "The capital of France is" --temperature 0
  deepinfer run -i examples/prompts.jsonl -o out.jsonl
  deepinfer run --model /path/to/DeepSeek-V2-Lite -i prompts.jsonl -o out.jsonl --max-tokens 256

Exit code: 0 when every request ran, 1 when any request got an error row (under a torchrun you
start yourself: 0, the summary counts them), 2 for bad flags, files or input lines (nothing runs),
130 when interrupted."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable

from deepinfer.cli import launch
from deepinfer.cli.engine_flags import KV_CACHE_DTYPES, add_engine_flags, check_engine_flags, load_llm, read_chat_template
from deepinfer.cli.flag_help import add_grouped_help
from deepinfer.cli.launch import launched_by_torchrun, run_as_rank, torchrun
from deepinfer.cli.request_fields import describe as describe_fields
from deepinfer.cli.run_output import (
    GENERATION_FAILED,
    INVALID_REQUEST,
    RUN_ROWS,
    InOrder,
    OutputFile,
    RowFormat,
    add_output_flags,
    check_output_args,
    check_unlocked,
    error_row,
    result_row,
    row_text,
    scan,
)
from deepinfer.cli.run_requests import BUILTIN_PROMPTS, Request, check_flag_params, collect_requests, make_params
from deepinfer.cli.structured_flags import add_structured_flags, check_structured_flags
from deepinfer.engine.chat import FixNames
from deepinfer.errors import UserError

__all__ = ["BUILTIN_PROMPTS", "KV_CACHE_DTYPES", "add_parser", "command_line", "load_llm", "run"]

INPUT_HELP = """the prompts: --prompt TEXT, or a JSONL file (-i); the line format and every request field
A line is {"prompt": "..."}, {"messages": [{"role": ..., "content": ...}]} (rendered by the chat
template) or {"prompt_token_ids": [...]}, with an "id" (default: the line number) and any request
field below (a field left out or null takes the flag's value); or an OpenAI batch line
{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" or "/v1/completions", "body":
{...}} (`deepinfer run-batch` reads such files and writes OpenAI's batch rows). A line whose fields
deepinfer cannot honour fails alone (an error row); a line that breaks the file (not a JSON object,
no usable id, a duplicate id) stops the run before it starts. examples/prompts.jsonl shows each kind.
"""

OUTPUT_HELP = """the rows: one JSON row per request, in input order, to -o FILE (else stdout)
A row is {"id" (or "custom_id"), "prompt", "text", "token_ids", "finish_reason", "prompt_tokens",
"completion_tokens"}, plus "logprobs" with "cumulative_logprob", and "prompt_logprobs", when asked
for (--logprobs N, --prompt-logprobs N or the line's fields): per position vLLM's {"<token id>":
{"logprob", "rank", "decoded_token"}}, the chosen token first, then the N most likely. A request
that fails alone gets {"id", "error": {"message", "type"}} and the others run. The output may not be
the input; the run locks it (a second run on it fails at once) and writes each row whole, so an
interrupted run can go on with --resume (error rows count as done: delete them to retry those)."""

SAMPLING_HELP = """the sampling options of every request without its own fields (vLLM's meaning)
A line's fields (temperature, top_p, max_tokens, stop, logprobs, ...) win over these flags; each
request samples with its own seed, from --seed and its line number, so a rerun repeats it."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "run",
        help="generate text for prompts (the default command)",
        description=__doc__.split("\n", 2)[2],
        usage="%(prog)s [--prompt TEXT | -i FILE] [-o FILE] [--model PATH] [FLAG ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    add_grouped_help(p)
    inputs = p.add_argument_group("input", f"{INPUT_HELP}\n{describe_fields()}")
    inputs.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for several)")
    inputs.add_argument("-i", "--input", metavar="FILE", help="prompts as JSONL: {\"prompt\": ...} or OpenAI batch lines (format above)")
    inputs.add_argument("--chat", action="store_true", help="wrap plain prompts in the tokenizer's chat template")
    add_output_flags(p, "one JSON row per request (a result or an error)", OUTPUT_HELP)
    sampling = p.add_argument_group("sampling", SAMPLING_HELP)
    sampling.add_argument("--max-tokens", type=int, default=16, metavar="N", help="tokens to generate per request at most (default 16, as vLLM)")
    sampling.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 is greedy (default 1.0)")
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default 1.0: off)")
    sampling.add_argument("--top-k", type=int, default=0, metavar="K",
                          help="keep the K most likely tokens, K <= 2**31-1 (default 0: off; K >= the vocabulary keeps all)")
    sampling.add_argument("--min-p", type=float, default=0.0, metavar="P", help="drop tokens below P times the top probability (default 0: off)")
    sampling.add_argument("--stop", action="append", metavar="TEXT", help="a stop string (repeat for several)")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    sampling.add_argument("--logprobs", type=int, metavar="N",
                          help="each row gets every generated token's logprob, rank and the N most likely tokens (0 to 20; 0: the chosen token only)")
    sampling.add_argument("--prompt-logprobs", type=int, metavar="N", help="each row gets the same for every prompt token but the first (0 to 20)")
    add_structured_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=run)
    global _PARSER
    _PARSER = p


_PARSER: argparse.ArgumentParser | None = None


def check_flags(args) -> None:
    """Flag values no run could use: one line naming the flag (exit 2), before anything starts."""
    check_engine_flags(args)
    check_structured_flags(args)
    check_flag_params(args)


# ---- running -----------------------------------------------------------------------------------


CLI_FIXES = FixNames(chat_template="pass --chat-template FILE", tokenizer="pass --tokenizer FOLDER (a folder that holds one)")


def render_prompt(llm, request: Request, chat: bool, chat_template: str | None = None) -> str | None:
    """The prompt text (None for token-id prompts): chat messages go through the chat template
    (`chat_template`: --chat-template's, else the tokenizer's, else the model's built-in format),
    as LLM.chat renders them."""
    messages = request.messages
    if messages is None and chat and request.prompt is not None:
        messages = [{"role": "user", "content": request.prompt}]
    if messages is None:
        return request.prompt
    return llm.render_conversation(messages, request.source, chat_template=chat_template, fixes=CLI_FIXES, **request.chat_options)


def to_stdout(text: str) -> None:
    """Print above the progress bar (tqdm redraws it below)."""
    from tqdm.auto import tqdm

    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def as_text(request: Request, prompt: str | None, output) -> str:
    completion = output.outputs[0]
    shown = prompt if prompt is not None else output.prompt_token_ids
    return f"[{request.id}] prompt: {shown!r}\n    completion: {completion.text!r} ({completion.finish_reason})"


@dataclass(frozen=True)
class Command:
    """What `run` and `run-batch` do differently. The rest is shared: the output file (locked,
    resumable, in input order) and expert parallelism's ranks and their launcher."""

    name: str  # the subcommand, as each rank torchrun starts parses it again
    rows: RowFormat  # the output's rows, which --resume reads
    check_flags: Callable[[argparse.Namespace], None]  # one line (exit 2) for flags no run could use
    request_ids: Callable[[argparse.Namespace], list[str]]  # every request's id as JSON text (a broken input: UserError)
    generate: Callable[..., int]  # generate(args, ctx, output, done): the run on one rank, its exit code
    parser: Callable[[], argparse.ArgumentParser]  # the subcommand's parser, to rebuild its command line


def run(args) -> int:
    return run_command(args, RUN)


def run_command(args, command: Command) -> int:
    """`command` alone, as N ranks it starts (--ep N), or as one rank of a torchrun."""
    command.check_flags(args)
    if not launched_by_torchrun():
        if (args.ep or 1) > 1:
            return launch_ranks(args, command)
        return run_rank(args, None, command)
    from deepinfer.distributed.environment import env_rank

    rank = env_rank()  # RANK=abc: one line naming it
    return run_as_rank(lambda: run_in_torchrun(args, command), rank)


def run_in_torchrun(args, command: Command) -> int:
    ctx = join_run(args)
    if ctx is None:  # torchrun with one process
        return run_rank(args, None, command)
    try:
        return launch.report_outcome(run_rank(args, ctx, command))  # failed requests: not a failed rank
    except UserError as exc:
        _failing.append(exc)
        if f"rank {ctx.rank}" not in str(exc):  # say which rank, once (keeping the error's class)
            exc.args = (f"rank {ctx.rank} of {ctx.world_size}: {exc}",)
        raise
    except BaseException as exc:
        _failing.append(exc)
        raise


def run_rank(args, ctx, command: Command) -> int:
    """The whole run on one process; `ctx`: its DistContext under torchrun (None: alone)."""
    first = ctx is None or ctx.rank == 0
    output, done, error = None, set(), None
    if first:  # only rank 0 touches the output file (locked for the whole run)
        try:
            path = check_output_args(args)
            if path is not None:
                output = OutputFile.open(path)
                if args.resume:
                    done = output.resume(command.rows)  # may drop a torn last line
        except UserError as exc:
            if ctx is None:
                raise
            error = str(exc)
    try:
        if ctx is not None:
            done, error = share_from_rank0(ctx, (sorted(done), error))
            done = set(done)
        if error is not None:
            raise UserError(error)
        return command.generate(args, ctx, output, done)
    finally:
        if output is not None:
            output.close()


def generate_all(args, ctx, output: OutputFile | None, done: set[str]) -> int:
    """Run every request not in `done`; write a row for each (rank 0). 1 when any request failed."""
    first = ctx is None or ctx.rank == 0
    requests, builtin = collect_requests(args)
    skipped = 0
    if done:
        remaining = [r for r in requests if json.dumps(r.id) not in done]
        skipped = len(requests) - len(remaining)
        requests = remaining
        if not requests:
            if first:
                print(f"deepinfer: nothing to do: all {skipped} requests are already in {args.output}", file=sys.stderr)
            return 0
    params = [make_params(args, r) if r.error is None else None for r in requests]  # refused values fail their line, before the model loads
    chat_template = read_chat_template(args.chat_template)
    llm = load_llm(args, ctx) if any(r.error is None for r in requests) else None  # all refused: no model needed
    refused: dict[int, str] = {i: r.error for i, r in enumerate(requests) if r.error is not None}
    prompts: list[str | None] = [None] * len(requests)
    for i, request in enumerate(requests):
        if i not in refused:
            try:
                prompts[i] = render_prompt(llm, request, args.chat, chat_template)
            except UserError as exc:
                refused[i] = str(exc)
    runnable = [i for i in range(len(requests)) if i not in refused]
    start = time.perf_counter()
    stream = iter(())
    if llm is not None:
        # Every prompt is checked (tokenized, its length against the model) before anything runs.
        inputs = [{"prompt": prompts[i]} if prompts[i] is not None else {"prompt_token_ids": requests[i].prompt_token_ids} for i in runnable]
        stream = llm.generate_iter(
            inputs, [params[i] for i in runnable], use_tqdm=not args.no_progress, names=[requests[i].source for i in runnable],
            on_invalid=lambda k, exc: refused.__setitem__(runnable[k], str(exc)),
        )  # fmt: skip
    counts = {"prompt": 0, "generated": 0, "failed": 0}
    # Prompts typed on the command line: shown as text (rows, as with -o, when they carry logprobs).
    readable = output is None and not args.input and args.logprobs is None and args.prompt_logprobs is None

    def emit(index: int, item) -> None:
        request = requests[index]
        if isinstance(item, str):  # an error message
            row = error_row(request, item, INVALID_REQUEST)
        else:
            row = result_row(request, prompts[index], item)
            counts["prompt"] += len(item.prompt_token_ids)
            counts["generated"] += len(item.outputs[0].token_ids)
        try:
            line = row_text(row)
        except UnicodeEncodeError as exc:  # a result that is not valid Unicode: its own error row, the run goes on
            row = error_row(request, f"{request.source}: its result cannot be written as UTF-8 ({exc.reason})", GENERATION_FAILED)
            line = row_text(row)
        counts["failed"] += "error" in row
        if readable:
            to_stdout(f"[{request.id}] error: {row['error']['message']}" if "error" in row else as_text(request, prompts[index], item))
        elif output is None:
            to_stdout(line)
        else:
            output.write(line)  # one write per row: a killed run leaves whole rows

    rows = InOrder(emit)  # rows go out in input order, with one process or several
    try:
        if first:
            if output is not None:
                output.begin(overwrite=args.overwrite)
            for index, message in sorted(refused.items()):
                rows.put(index, message)
        for k, result in stream:
            rows.put(runnable[k], result)
    finally:
        if llm is not None:
            stream.close()
    wall = time.perf_counter() - start
    if first:
        print_summary(llm, len(requests), skipped, counts, wall, args.output, builtin)
    return 1 if counts["failed"] else 0


# ---- expert parallelism: one process per rank, started by torchrun ------------------------------

_failing: list[BaseException] = []  # set once this rank is failing: a later SIGTERM adds no second line


def join_run(args):
    """Join the process group (every rank), and turn torchrun's SIGTERM (another rank failed)
    into a one-line error."""
    from deepinfer.distributed.group import PeerFailure, env_rank, env_world_size, init_distributed
    from deepinfer.plugins import load_plugins

    world, rank = env_world_size(), env_rank()
    if args.ep is not None and args.ep != world:
        raise UserError(f"--ep {args.ep}, but torchrun started {world} processes; expert parallelism spans all of them (leave --ep out under torchrun)")

    def stopped(signum, frame):
        if _failing:  # already on its way out with its own error
            return
        _failing.append(None)
        raise PeerFailure(f"rank {rank} of {world}: stopped by torchrun (signal {signum}) because another rank failed; see that rank's error")

    signal.signal(signal.SIGTERM, stopped)
    plugins = load_plugins()
    spec = plugins.auto()[0] if args.backend == "auto" else plugins.backend(args.backend)
    return init_distributed(args.dist_timeout, device=spec.device(args.interpret))  # None: WORLD_SIZE=1


def share_from_rank0(ctx, value):
    """Rank 0's `value` on every rank (a broadcast of a picklable object)."""
    import torch.distributed as dist

    from deepinfer.distributed.group import collective_failure

    box = [value if ctx.rank == 0 else None]
    try:
        dist.broadcast_object_list(box, src=0, group=ctx.group)
    except Exception as exc:
        raise collective_failure(ctx, "sharing the output file's state from rank 0", exc) from exc
    return box[0]


def launch_ranks(args, command: Command) -> int:
    """`deepinfer run --ep N` (or run-batch) on one host: check once what every rank would check,
    then start N ranks with torchrun (one line if one of them fails)."""
    left = preflight(args, command)
    if left == 0:
        print(f"deepinfer: nothing to do: every request is already in {args.output}", file=sys.stderr)
        return 0
    check_ep_setup(args)
    words = [command.name, *launch.command_line(command.parser(), args)]
    return torchrun(args.ep, words, what=command.name, verbose=getattr(args, "verbose", False))


def preflight(args, command: Command) -> int:
    """The output file, the lock and the requests, checked as rank 0 will (changing nothing);
    the number of requests left to run."""
    from deepinfer.options import parse_assignments

    parse_assignments(args.backend_option)
    path = check_output_args(args)
    done: set[str] = set()
    if path is not None:
        check_unlocked(path)
        if args.resume and path.exists():
            done = scan(path, command.rows).done
    return sum(key not in done for key in command.request_ids(args))


def check_ep_setup(args) -> None:
    """The backend is available with a device per rank; the model's experts (+ redundant) divide
    over the ranks; the --expert-load file reads. One line (exit 2) otherwise."""
    from deepinfer.model.loader import load_config
    from deepinfer.plugins import load_plugins

    plugins = load_plugins()
    spec = plugins.auto()[0] if args.backend == "auto" else plugins.require(args.backend, args.interpret)
    device = spec.device(args.interpret)
    have = spec.local_devices(args.interpret)
    if have is not None and have < args.ep:
        raise UserError(f"--ep {args.ep} needs one {device} device per rank, and this host has {have} (backend {spec.name})")
    from deepinfer.model.embedded import ensure_embedded
    from deepinfer.model.embedded_names import check_model_path, resolve_model

    embedded = resolve_model(args.model)[1]
    folder = ensure_embedded(alias=embedded) if embedded is not None else check_model_path(args.model)  # generated once, before the ranks race for it
    config = load_config(folder)
    if config.model_type == "deepseek_v4":
        raise UserError("expert parallelism (--ep) is not implemented for DeepSeek-V4 yet; run it with --ep 1")
    if config.model_type == "deepseek_v41":  # before the ranks start, so that one process says it, once
        raise UserError("expert parallelism (--ep, redundant experts) is not implemented for DeepSeek-V4.1 yet; run it with --ep 1")
    experts = config.n_routed_experts or 0
    if not experts:
        raise UserError(f"model {folder} has no routed experts: --ep shards the experts of a MoE model")
    physical = experts + args.num_redundant_experts
    if physical % args.ep:
        fit = (-experts) % args.ep
        raise UserError(
            f"{experts} routed experts + {args.num_redundant_experts} redundant = {physical} experts per layer do not divide over "
            f"--ep {args.ep} ranks; choose --num-redundant-experts so that they do (e.g. {fit}) or another --ep"
        )
    if args.expert_load is not None:
        try:
            with open(args.expert_load, encoding="utf-8") as f:
                json.load(f)
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read the expert load {args.expert_load}: {exc}") from None


def command_line(args) -> list[str]:
    """The `run` options of `args` as command-line words (those that differ from the defaults)."""
    return launch.command_line(_PARSER, args)


def print_summary(llm, requests: int, skipped: int, counts: dict, wall: float, output, builtin: bool) -> None:
    """The run's summary on stderr; `llm` None when no request got as far as the model."""
    from deepinfer.engine.progress import rate

    per_s = lambda n: rate(n / wall) if wall > 0 else "0"  # noqa: E731
    failed = counts["failed"]
    where = f"error rows in {output}" if output else "error rows above"
    rows = [
        ("requests", f"{requests}" + (f" ({skipped} already in {output}, skipped)" if skipped else "") + (f"; {failed} failed ({where})" if failed else "")),
        ("prompt tokens", f"{counts['prompt']}"),
        ("generated tokens", f"{counts['generated']}"),
        ("wall time", f"{wall:.2f} s"),
        # vLLM's offline throughput: over the wall time, so prompt tokens count in the total rather than as a prefill rate
        ("throughput", f"{per_s(requests - failed)} requests/s, {per_s(counts['prompt'] + counts['generated'])} total tok/s (prompt + generated), "
                       f"{per_s(counts['generated'])} generated tok/s"),  # fmt: skip
    ]
    if llm is not None:
        model = llm.model_path + (" (dummy weights: random, the text is gibberish)" if llm.dummy_weights else "")
        rows += [
            ("backend", llm.chosen_by),  # "ascend (requested)" or "auto-selected reference (...)"
            ("model", model),
        ]
        per_token, per_request = llm.cache_bytes_held()
        rows.append(("cache held", f"{per_token:.6g} B per token of history" + (f" + {per_request} B per request (fixed)" if per_request else "")))
        spec = llm.speculative_metrics()
        if spec is not None:
            rows.append(("speculative", f"{spec['acceptance_length']:.2f} tokens per verification (acceptance length), "
                                        f"{spec['drafts_verified_per_step']:.2f} drafts verified per request and step, "
                                        f"{spec['accepted_per_verified']:.1%} of them accepted"))  # fmt: skip
        tiers = llm.kv_tier_stats()
        if tiers is not None:
            rows.append(("kv tiers", "; ".join(tier_summary(name, t) for name, t in tiers.items())))
        if llm.engine.runtime.device.type == "cpu":
            import torch

            rows.append(("cpu threads", f"{torch.get_num_threads()}"))
    if output is not None:
        rows.append(("output", str(output)))
    lines = ["summary:"] + [f"  {name:<17} {value}" for name, value in rows]
    if builtin:
        lines.append("  (built-in prompts; pass --prompt TEXT or -i prompts.jsonl, and --model PATH for a real checkpoint)")
    print("\n".join(lines), file=sys.stderr)


def tier_summary(name: str, t: dict) -> str:
    """One tier's line of the summary: what was loaded from it and stored to it, and what it lost."""
    lost = ", ".join(f"{t[k]} {k}" for k in ("evictions", "expired", "errors", "corrupt") if t[k])
    return (f"{name}: {t['hit_blocks']} blocks loaded ({t['hit_bytes'] / 1e6:.3g} MB) by {t['loads']} requests, {t['stores']} stored, "
            f"{t['entries']} held" + (f" ({lost})" if lost else ""))  # fmt: skip


RUN = Command(
    "run", RUN_ROWS, check_flags, lambda args: [json.dumps(r.id) for r in collect_requests(args)[0]], generate_all, lambda: _PARSER,
)
