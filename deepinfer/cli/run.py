"""`deepinfer run`: offline generation for prompts from the command line or a JSONL file.

Input lines are `{"prompt": ..., "id": ...}` (or `"messages": [...]`, optional sampling keys such
as "max_tokens" and "temperature"), or OpenAI batch lines `{"custom_id": ..., "body": {...}}`.
Each finished request is written to the output at once and flushed, so an interrupted run keeps
its results; `--resume` skips the ids already in the output file and appends the rest. With no
prompts at all it runs a few built-in prompts on the embedded default model.

Expert parallelism: `--ep N` shards the experts over N devices of this host, one process each
(it starts `torchrun --standalone --nproc-per-node N -m deepinfer run ...`); each rank runs every
N-th request (attention data parallel) and rank 0 writes the output, in input order. Under
torchrun (several hosts: see docs/distributed.md) `--ep` defaults to the number of processes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from deepinfer.cli import launch
from deepinfer.cli.launch import launched_by_torchrun, torchrun
from deepinfer.cli.launch import wait as _wait  # noqa: F401  (imported from here by other commands)
from deepinfer.errors import UserError

BUILTIN_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
    "def fibonacci(n):",
]

# JSONL keys that map onto SamplingParams (OpenAI's names; max_completion_tokens is its newer name).
SAMPLING_KEYS = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "run",
        help="generate text for prompts (the default command)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", default="auto", help="auto (cuda, then ascend, then reference), cuda, ascend or reference")
    p.add_argument("--model", metavar="PATH", help="an HF checkpoint folder (default: the embedded tiny model, dummy weights)")
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for several)")
    p.add_argument("-i", "--input", metavar="FILE", help="prompts as JSONL: {\"prompt\": ...} or OpenAI batch lines")
    p.add_argument("-o", "--output", metavar="FILE", help="write results as JSONL, each line as its request finishes")
    p.add_argument("--resume", action="store_true", help="skip ids already in --output and append the rest")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    p.add_argument("--chat", action="store_true", help="wrap plain prompts in the tokenizer's chat template")
    p.add_argument("--max-tokens", type=int, default=16, metavar="N", help="tokens to generate per request at most (default 16, as vLLM)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 is greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (default 0: off)")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P", help="drop tokens below P times the top probability (default 0: off)")
    p.add_argument("--stop", action="append", metavar="TEXT", help="a stop string (repeat for several)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--seed", type=int, default=0, help="seed from which each request's sampling seed is derived (default 0)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"), help="auto: bfloat16 on accelerators, float32 on the CPU")
    p.add_argument("--allow-fallback", action="store_true", help="let the reference serve ops the backend has no kernel for")
    p.add_argument("--max-num-seqs", type=int, default=256, metavar="N", help="sequences per step at most (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, metavar="N", help="tokens per step; longer prompts prefill in chunks (default 8192)")
    p.add_argument("--num-kv-blocks", type=int, metavar="N", help="KV cache pages (default: from the memory budget)")
    p.add_argument("--no-prefix-caching", action="store_true", help="switch the prefix cache off")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (cuda backend)")
    p.add_argument("--interpret", action="store_true", help="run the backend's Triton kernels in the Triton interpreter on the CPU (slow; for checking kernels)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    ep = p.add_argument_group("expert parallelism (see docs/distributed.md)")
    ep.add_argument("--ep", type=int, metavar="N", help="shard the experts over N devices, one process each (default 1; under torchrun: its process count)")
    ep.add_argument("--num-redundant-experts", type=int, default=0, metavar="R", help="extra copies of busy experts per MoE layer (experts + R must divide by N)")
    ep.add_argument("--eplb", action="store_true", help="count the expert load and re-place the experts by EPLB every --eplb-interval steps")
    ep.add_argument("--eplb-interval", type=int, default=1000, metavar="STEPS", help="steps between EPLB rebalances (default 1000)")
    ep.add_argument("--expert-load", metavar="FILE", help="JSON [MoE layers][experts] token counts: place the experts by EPLB from the start")
    ep.add_argument("--dist-timeout", type=float, default=300.0, metavar="S", help="seconds a rank waits for the others in a collective before the run fails (default 300)")
    p.set_defaults(func=run)
    global _PARSER
    _PARSER = p


_PARSER: argparse.ArgumentParser | None = None


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


# ---- reading requests --------------------------------------------------------------------------


def read_jsonl_requests(path: str) -> list[Request]:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"input file {path} not found" if not file.exists() else f"input {path} is not a file")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    requests: list[Request] = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            requests.append(parse_line(line, f"{path} line {number}", number))
    if not requests:
        raise UserError(f"input file {path} has no prompts")
    return requests


def parse_line(line: str, where: str, number: int) -> Request:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(item, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(item).__name__}")
    if "custom_id" in item or "body" in item:  # OpenAI batch line
        body = item.get("body")
        if not isinstance(body, dict):
            raise UserError(f"{where}: an OpenAI batch line needs a \"body\" object")
        if "custom_id" not in item:
            raise UserError(f"{where}: an OpenAI batch line needs a \"custom_id\"")
        request = Request(item["custom_id"], "custom_id", where, number)
        source = body
    else:
        request = Request(item.get("id", number), "id", where, number)
        source = item
    if not isinstance(request.id, (str, int)) or isinstance(request.id, bool):
        raise UserError(f"{where}: {request.id_key} must be a string or an integer, got {request.id!r}")
    if source.get("n", 1) != 1:
        raise UserError(f"{where}: n={source['n']!r} is not supported; one completion per request")
    if "messages" in source:
        messages = source["messages"]
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
        ):
            raise UserError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": str, \"content\": str}}")
        request.messages = messages
    elif "prompt_token_ids" in source:
        ids = source["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise UserError(f"{where}: \"prompt_token_ids\" must be a list of integers")
        request.prompt_token_ids = ids
    elif "prompt" in source:
        if not isinstance(source["prompt"], str):
            raise UserError(f"{where}: \"prompt\" must be a string")
        request.prompt = source["prompt"]
    else:
        raise UserError(f"{where}: no \"prompt\", \"messages\" or \"prompt_token_ids\"" + (" in \"body\"" if source is not item else ""))
    request.overrides = {SAMPLING_KEYS[k]: v for k, v in source.items() if k in SAMPLING_KEYS}
    return request


def collect_requests(args) -> tuple[list[Request], bool]:
    """The requests, and whether they are the built-in demo prompts."""
    if args.prompt and args.input:
        raise UserError("give prompts either with --prompt or with -i/--input, not both")
    if args.input:
        requests = read_jsonl_requests(args.input)
    elif args.prompt:
        requests = [Request(n, "id", f"--prompt {n}", n, prompt=text) for n, text in enumerate(args.prompt, start=1)]
    else:
        return [Request(n, "id", f"built-in prompt {n}", n, prompt=text) for n, text in enumerate(BUILTIN_PROMPTS, start=1)], True
    seen: dict[str, str] = {}
    for request in requests:
        key = json.dumps(request.id)
        if key in seen:
            raise UserError(f"{request.source}: duplicate {request.id_key} {request.id!r} (first at {seen[key]})")
        seen[key] = request.source
    return requests, False


def make_params(args, request: Request):
    from deepinfer.engine.llm_engine import derive_seed
    from deepinfer.engine.sampling_params import SamplingParams

    values = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        seed=derive_seed(args.seed, request.ordinal),  # per request, not per batch: a resumed run repeats
    )
    values.update(request.overrides)
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        raise UserError(f"{request.source}: {exc}") from None


# ---- the output file ---------------------------------------------------------------------------


def finished_ids(path: Path) -> set[str]:
    """Ids already in an output file (as JSON text). A torn last line (the run was killed while
    writing it) is cut off; any other bad line is an error, never silently dropped."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        if _is_result(data[cut:]):  # complete, only its newline is missing
            with path.open("ab") as f:
                f.write(b"\n")
            data += b"\n"
        else:
            print(f"deepinfer: {path}: dropping an unfinished last line from an interrupted run", file=sys.stderr)
            with path.open("r+b") as f:
                f.truncate(cut)
            data = data[:cut]
    done = set()
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path} line {number} is not valid JSON; fix or remove it, then --resume again") from None
        key = "custom_id" if isinstance(item, dict) and "custom_id" in item else "id"
        if not isinstance(item, dict) or key not in item:
            raise UserError(f"{path} line {number} has no \"id\" or \"custom_id\"; is this a deepinfer output file?")
        done.add(json.dumps(item[key]))
    return done


def _is_result(line: bytes) -> bool:
    try:
        item = json.loads(line)
    except ValueError:
        return False
    return isinstance(item, dict) and ("id" in item or "custom_id" in item) and "text" in item


def check_output(args) -> Path | None:
    if args.resume and args.overwrite:
        raise UserError("--resume and --overwrite contradict each other; pick one")
    if args.resume and not args.output:
        raise UserError("--resume needs -o/--output: the file whose finished ids to skip")
    if args.overwrite and not args.output:
        raise UserError("--overwrite needs -o/--output")
    if not args.output:
        return None
    path = Path(args.output)
    if path.is_dir():
        raise UserError(f"output {path} is a directory")
    if path.exists() and path.stat().st_size > 0 and not (args.resume or args.overwrite):
        raise UserError(f"output file {path} already exists; pass --resume to continue it or --overwrite to replace it")
    if not path.parent.exists():
        raise UserError(f"output folder {path.parent} does not exist")
    return path


# ---- running -----------------------------------------------------------------------------------


def render_prompt(tokenizer, request: Request, chat: bool) -> str | None:
    """The prompt text (None for token-id prompts): chat messages go through the chat template."""
    messages = request.messages
    if messages is None and chat and request.prompt is not None:
        messages = [{"role": "user", "content": request.prompt}]
    if messages is None:
        return request.prompt
    if tokenizer is None or not getattr(tokenizer, "has_chat_template", True):
        raise UserError(f"{request.source}: chat messages need a chat template, and this model's tokenizer has none")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def result_line(request: Request, prompt: str, output) -> dict:
    completion = output.outputs[0]
    return {
        request.id_key: request.id,
        "prompt": prompt,
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": len(completion.token_ids),
    }


def to_stdout(text: str) -> None:
    """Print above the progress bar (tqdm redraws it below)."""
    from tqdm.auto import tqdm

    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def as_text(request: Request, prompt: str | None, output) -> str:
    completion = output.outputs[0]
    shown = prompt if prompt is not None else output.prompt_token_ids
    return f"[{request.id}] prompt: {shown!r}\n    completion: {completion.text!r} ({completion.finish_reason})"


def run(args) -> int:
    if args.ep is not None and args.ep < 1:
        raise UserError(f"--ep must be >= 1, got {args.ep}")
    if not launched_by_torchrun():
        if (args.ep or 1) > 1:
            return launch_torchrun(args)
        return run_rank(args, None)
    ctx = join_run(args)
    if ctx is None:  # torchrun with one process
        return run_rank(args, None)
    try:
        return run_rank(args, ctx)
    except UserError as exc:
        _failing.append(exc)
        if f"rank {ctx.rank}" not in str(exc):  # say which rank, once
            error = UserError(f"rank {ctx.rank} of {ctx.world_size}: {exc}")
            error.exit_code = exc.exit_code
            raise error from None
        raise
    except BaseException as exc:
        _failing.append(exc)
        raise


def run_rank(args, ctx) -> int:
    """The whole run on one process; `ctx`: its DistContext under torchrun (None: alone)."""
    first = ctx is None or ctx.rank == 0
    output_path, done, error = None, set(), None
    if first:  # only rank 0 touches the output file (a --resume may repair its torn last line)
        try:
            output_path = check_output(args)
            if output_path is not None and args.resume and output_path.exists():
                done = finished_ids(output_path)
        except UserError as exc:
            if ctx is None:
                raise
            error = str(exc)
    if ctx is not None:
        done, error = share_from_rank0(ctx, (sorted(done), error))
        done = set(done)
    if error is not None:
        raise UserError(error)
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
    params = [make_params(args, r) for r in requests]  # bad values fail before the model loads

    from deepinfer.engine.llm import LLM

    llm = LLM(
        model=args.model,
        backend=args.backend,
        dtype=args.dtype,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager,
        interpret=args.interpret,
        allow_fallback=args.allow_fallback,
        ep=ctx.world_size if ctx is not None else 1,
        num_redundant_experts=args.num_redundant_experts,
        eplb_interval=args.eplb_interval if args.eplb else None,
        expert_load=args.expert_load,
        dist_timeout=args.dist_timeout,
    )
    prompts = [render_prompt(llm.tokenizer, r, args.chat) for r in requests]
    inputs = [{"prompt": p} if p is not None else {"prompt_token_ids": r.prompt_token_ids} for p, r in zip(prompts, requests)]
    start = time.perf_counter()
    # Every prompt is checked before anything runs or the output file is opened.
    stream = llm.generate_iter(inputs, params, use_tqdm=not args.no_progress, names=[r.source for r in requests])
    prompt_tokens = generated = 0
    try:
        sink = open_output(output_path, append=args.resume) if output_path else None
    except UserError:
        stream.close()
        raise
    readable = sink is None and not args.input  # prompts typed on the command line: show them as text

    def emit(index: int, output) -> None:
        request, prompt = requests[index], prompts[index]
        if readable:
            to_stdout(as_text(request, prompt, output))
            return
        line = json.dumps(result_line(request, prompt, output), ensure_ascii=False)
        if sink is None:
            to_stdout(line)
        else:
            sink.write(line + "\n")
            sink.flush()  # an interrupted run keeps every finished request

    # One process writes as requests finish; ranks of a data-parallel run finish out of order, so
    # rank 0 writes each result once every earlier one is out: the file is in input order.
    in_order = ctx is not None
    waiting: dict[int, object] = {}
    next_index = 0
    try:
        for index, output in stream:
            prompt_tokens += len(output.prompt_token_ids)
            generated += len(output.outputs[0].token_ids)
            if not in_order:
                emit(index, output)
                continue
            waiting[index] = output
            while next_index in waiting:
                emit(next_index, waiting.pop(next_index))
                next_index += 1
    finally:
        stream.close()
        if sink is not None:
            sink.close()
    wall = time.perf_counter() - start
    if first:
        print_summary(llm, len(requests), skipped, prompt_tokens, generated, wall, output_path, builtin)
    return 0


# ---- expert parallelism: one process per rank, started by torchrun ------------------------------

_failing: list[BaseException] = []  # set once this rank is failing: a later SIGTERM adds no second line


def join_run(args):
    """Join the process group (every rank), and turn torchrun's SIGTERM (another rank failed)
    into a one-line error."""
    from deepinfer.distributed.group import DistributedError, init_distributed
    from deepinfer.plugins import load_plugins

    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if args.ep is not None and args.ep != world:
        raise UserError(f"--ep {args.ep}, but torchrun started {world} processes; expert parallelism spans all of them (leave --ep out under torchrun)")

    def stopped(signum, frame):
        if _failing:  # already on its way out with its own error
            return
        _failing.append(None)
        raise DistributedError(f"rank {rank} of {world}: stopped by torchrun (signal {signum}) because another rank failed; see that rank's error")

    signal.signal(signal.SIGTERM, stopped)
    plugins = load_plugins()
    spec = plugins.auto()[0] if args.backend == "auto" else plugins.backend(args.backend)
    return init_distributed(args.dist_timeout, device=spec.device(args.interpret))  # None: WORLD_SIZE=1


def share_from_rank0(ctx, value):
    """Rank 0's `value` on every rank (a broadcast of a picklable object)."""
    import torch.distributed as dist

    from deepinfer.engine.data_parallel import collective_failure

    box = [value if ctx.rank == 0 else None]
    try:
        dist.broadcast_object_list(box, src=0, group=ctx.group)
    except Exception as exc:
        raise collective_failure(ctx, "sharing the output file's state from rank 0", exc) from exc
    return box[0]


def launch_torchrun(args) -> int:
    """`deepinfer run --ep N` on one host: start N ranks with torchrun, each running this command."""
    return torchrun(args.ep, ["run", *command_line(args)], what="run", verbose=getattr(args, "verbose", False))


def command_line(args) -> list[str]:
    """The `run` options of `args` as command-line words (those that differ from the defaults)."""
    return launch.command_line(_PARSER, args)


def open_output(path: Path, append: bool) -> TextIO:
    try:
        return path.open("a" if append else "w", encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}") from None


def print_summary(llm, requests: int, skipped: int, prompt_tokens: int, generated: int, wall: float, output_path, builtin: bool) -> None:
    rate = lambda n: n / wall if wall > 0 else 0.0  # noqa: E731
    model = llm.model_path + (" (dummy weights: random, the text is gibberish)" if llm.dummy_weights else "")
    rows = [
        ("requests", f"{requests}" + (f" ({skipped} already in {output_path}, skipped)" if skipped else "")),
        ("prompt tokens", f"{prompt_tokens}"),
        ("generated tokens", f"{generated}"),
        ("wall time", f"{wall:.2f} s"),
        ("throughput", f"{rate(prompt_tokens):.1f} prompt tok/s, {rate(generated):.1f} generated tok/s"),
        ("backend", f"{llm.backend} ({llm.chosen_by})"),
        ("model", model),
    ]
    if output_path is not None:
        rows.append(("output", str(output_path)))
    lines = ["summary:"] + [f"  {name:<17} {value}" for name, value in rows]
    if builtin:
        lines.append("  (built-in prompts; pass --prompt TEXT or -i prompts.jsonl, and --model PATH for a real checkpoint)")
    print("\n".join(lines), file=sys.stderr)
