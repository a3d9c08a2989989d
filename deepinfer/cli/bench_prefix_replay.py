"""`deepinfer bench prefix-replay`: what a prefix-cache hit costs DeepSeek-V4 as the cached prefix grows.

A V4 hit restores the paged caches and recomputes only the last `prefix_replay_tokens` tokens before
the new ones (128: they rebuild the compressors' open windows; bounded replay). For each prefix
length: the prefix alone is run first (a full prefill that fills the cache), then the prefix plus
--new-tokens fresh tokens (a hit, --repeat times with different new tokens; the fastest counts). It
reports the prompt tokens the hit computed (the engine's count, replay included), its time to the
first token, and, for prefix lengths up to --no-cache-max-len, the same request on an engine
without prefix caching over the same weights (tokens, time, and whether the greedy tokens are
identical). Runs on the reference backend and the embedded tiny-v4 unless told otherwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer.errors import UserError


def add_parser(what) -> None:
    from deepinfer.cli.bench import add_backend_option_flag

    p = what.add_parser(
        "prefix-replay",
        help="DeepSeek-V4 prefix-cache hits: prefill tokens and time as the cached prefix grows (bounded replay)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", default="reference",
                   help="reference (the default), auto (as for `run`: cuda, then ascend, then reference) or a backend from `deepinfer backends`")
    p.add_argument("--model", default="tiny-v4", metavar="PATH",
                   help="an HF checkpoint folder, or tiny-v4 / tiny-v3: an embedded tiny model (default tiny-v4)")
    p.add_argument("--prefix-lens", type=int, nargs="+", default=[1024, 8192, 32768], metavar="L",
                   help="cached prefix lengths in tokens (default 1024 8192 32768)")
    p.add_argument("--new-tokens", type=int, default=16, metavar="N", help="prompt tokens after the cached prefix (default 16)")
    p.add_argument("--output-tokens", type=int, default=8, metavar="N", help="greedy tokens generated per request and compared (default 8)")
    p.add_argument("--repeat", type=int, default=3, metavar="N", help="timed hits per prefix length, the fastest counts (default 3)")
    p.add_argument("--no-cache-max-len", type=int, default=None, metavar="L",
                   help="run the comparison without prefix caching only for prefix lengths up to L (default: every length; 0: none)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                   help="tokens per prefill step (default 2048: the reference ops gather [tokens, keys, dim] per step)")
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float16", "float32"), help="model dtype (default float32)")
    p.add_argument("--cpu-threads", type=int, metavar="N",
                   help="torch's CPU threads (default on the CPU: OMP_NUM_THREADS if set, else the usable cores but one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument("--json", "--out", dest="json", type=Path, default=None, metavar="FILE", help="write the results to FILE")
    add_backend_option_flag(p, "the engine")
    p.set_defaults(func=run_prefix_replay)


def model_positions(model: str) -> int:
    """The model's max_position_embeddings, from its config (before loading anything)."""
    from deepinfer.model.embedded import EMBEDDED, resolve_model
    from deepinfer.model.loader import load_config

    path, alias = resolve_model(model)
    if alias is not None:
        return EMBEDDED[alias].max_position_embeddings
    return int(load_config(Path(path).expanduser()).max_position_embeddings)


def run_prefix_replay(args: argparse.Namespace) -> int:
    from deepinfer.bench import prefix_replay
    from deepinfer.cli.bench import backend_options, choose_backend
    from deepinfer.engine.cpu_threads import MAX_CPU_THREADS
    from deepinfer.plugins import load_plugins

    given = backend_options(args)
    for name, value in (("--prefix-lens", min(args.prefix_lens)), ("--new-tokens", args.new_tokens), ("--output-tokens", args.output_tokens),
                        ("--repeat", args.repeat), ("--max-num-batched-tokens", args.max_num_batched_tokens)):  # fmt: skip
        if value < 1:
            raise UserError(f"{name} must be at least 1, not {value}")
    if args.no_cache_max_len is not None and args.no_cache_max_len < 0:
        raise UserError(f"--no-cache-max-len must be at least 0, not {args.no_cache_max_len}")
    if args.cpu_threads is not None and not 1 <= args.cpu_threads <= MAX_CPU_THREADS:
        raise UserError(f"--cpu-threads must lie in [1, {MAX_CPU_THREADS}], got {args.cpu_threads}")
    positions = model_positions(args.model)
    longest = max(args.prefix_lens) + args.new_tokens + args.output_tokens
    if longest > positions:
        raise UserError(f"the longest --prefix-lens + --new-tokens + --output-tokens = {longest} exceeds the model's {positions} positions")
    if args.json is not None and not args.json.parent.exists():
        raise UserError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    spec = choose_backend(load_plugins(), args.backend)  # one line when it cannot run here
    spec.resolve_options(given)  # unknown options and bad values: one line, before the model is loaded
    settings, results = prefix_replay.run(
        spec.name, args.model, tuple(args.prefix_lens), args.new_tokens, args.output_tokens, args.repeat, args.no_cache_max_len,
        args.max_num_batched_tokens, args.dtype, args.seed, args.json, given, args.cpu_threads,
    )  # fmt: skip
    print(prefix_replay.format_results(settings, results))
    return 0
