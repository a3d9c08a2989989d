"""`deepinfer bench swa-replay`: DeepSeek-V4.1's decoder SWA bounded replay on against off, as the prompt grows.

With the replay on (the default of `run`, `LLM`), a prefill runs the encoder layers (up to the last KV source) on
every prompt token and the decoder layers only on the prompt's last sliding_window + dspark_block_size tokens: an
approximation of a full prefill. For each prompt length this reports the last position's largest logit
difference, whether the greedy continuations agree (and where they first differ), the layer-token rows each
prefill computes and its time to the first token. Runs on the reference backend and the embedded tiny-v41
unless told otherwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer.errors import UserError


def add_parser(what) -> None:
    from deepinfer.cli.bench import add_backend_option_flag

    p = what.add_parser(
        "swa-replay",
        help="DeepSeek-V4.1's decoder SWA bounded replay on vs off: logit distance, greedy agreement, prefill rows and time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", default="reference",
                   help="reference (the default), auto (as for `run`: cuda, then ascend, then reference) or a backend from `deepinfer backends`")
    p.add_argument("--model", default="tiny-v41", metavar="PATH", help="a DeepSeek-V4.1 checkpoint folder, or tiny-v41: the embedded one (default)")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[256, 512, 960], metavar="L", help="prompt lengths in tokens (default 256 512 960)")
    p.add_argument("--output-tokens", type=int, default=32, metavar="N", help="greedy tokens generated and compared per prompt (default 32)")
    p.add_argument("--repeat", type=int, default=3, metavar="N", help="timed prefills per prompt and setting, the fastest counts (default 3)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N", help="tokens per prefill step (default 2048)")
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float16", "float32"), help="model dtype (default float32)")
    p.add_argument("--cpu-threads", type=int, metavar="N",
                   help="torch's CPU threads (default on the CPU: OMP_NUM_THREADS if set, else the usable cores but one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument("--json", "--out", dest="json", type=Path, default=None, metavar="FILE", help="write the results to FILE")
    add_backend_option_flag(p, "the engines")
    p.set_defaults(func=run_swa_replay)


def _model_type(model: str) -> str | None:
    """The model's model_type, from its config.json (before loading anything)."""
    from deepinfer.model.embedded import EMBEDDED, resolve_model
    from deepinfer.model.embedded_names import check_model_path
    from deepinfer.model.loader import load_config

    path, alias = resolve_model(model)
    if alias is not None:
        return EMBEDDED[alias].config.get("model_type")
    return load_config(check_model_path(path)).model_type


def run_swa_replay(args: argparse.Namespace) -> int:
    from deepinfer.bench import swa_replay
    from deepinfer.cli.bench import backend_options, choose_backend
    from deepinfer.cli.bench_prefix_replay import model_positions
    from deepinfer.engine.cpu_threads import MAX_CPU_THREADS
    from deepinfer.plugins import load_plugins

    given = backend_options(args)
    for name, value in (("--prompt-lens", min(args.prompt_lens)), ("--output-tokens", args.output_tokens), ("--repeat", args.repeat),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens)):  # fmt: skip
        if value < 1:
            raise UserError(f"{name} must be at least 1, not {value}")
    if args.cpu_threads is not None and not 1 <= args.cpu_threads <= MAX_CPU_THREADS:
        raise UserError(f"--cpu-threads must lie in [1, {MAX_CPU_THREADS}], got {args.cpu_threads}")
    kind = _model_type(args.model)
    if kind != "deepseek_v41":
        raise UserError(f"--model {args.model} is {kind}: the decoder SWA bounded replay is DeepSeek-V4.1's (try tiny-v41)")
    positions = model_positions(args.model)
    longest = max(args.prompt_lens) + args.output_tokens
    if longest > positions:
        raise UserError(f"the longest --prompt-lens + --output-tokens = {longest} exceeds the model's {positions} positions")
    if args.json is not None and not args.json.parent.exists():
        raise UserError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    spec = choose_backend(load_plugins(), args.backend)  # one line when it cannot run here
    spec.resolve_options(given)  # unknown options and bad values: one line, before the model is loaded
    settings, results = swa_replay.run(
        spec.name, args.model, tuple(args.prompt_lens), args.output_tokens, args.repeat, args.max_num_batched_tokens, args.dtype, args.seed,
        args.json, given, args.cpu_threads,
    )  # fmt: skip
    print(swa_replay.format_results(settings, results))
    return 0
