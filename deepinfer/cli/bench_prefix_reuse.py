"""`deepinfer bench prefix-reuse`: the KV tiers behind the device prefix cache on DeepSeek's production workload
shape: --conversations long conversations of --turns turns, each turn's prompt the previous prompt, its output and
--turn-tokens new tokens, sent round-robin (turn 1 of every conversation, then turn 2 of every one, ...), so that
the working set (every conversation's context) is --working-set-multiple times the device KV pool (or give the pool:
--num-kv-blocks, --kv-cache-gib).

The same workload runs on fresh engines over the same random weights (--model-shape v2-lite or v4-flash, cut with
--layers): "device" (the prefix cache alone), "host" (+ a host tier, --kv-offload-cpu-gib, default the working set's
size), "disk" (+ a disk tier in --kv-offload-dir, default a temporary folder), "restart" (a second process with only
the disk tier on that folder, replaying the workload: its hits come from disk) and "unbounded" (a pool that never
evicts: the hit rate's upper bound); --configs picks some. Per configuration: the hit rate, overall and by where
the tokens came from (device, host, disk, store), the prefill tokens computed and their ratio to the device-only
run, TTFT p50 / p99 from submission (at most --max-concurrency requests in flight, default a whole turn's wave),
output tokens/s, wall time, and how many requests' greedy tokens equal the device-only run's (all of them in
deterministic mode, the default: anything else exits 1). deepinfer/bench/prefix_reuse.py says how.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deepinfer.errors import UserError


def add_parser(what) -> None:
    from deepinfer.bench.prefix_reuse import CONFIGS
    from deepinfer.bench.prefix_reuse_model import MODEL_SHAPES
    from deepinfer.cli.bench import BACKEND_HELP, add_backend_option_flag

    p = what.add_parser("prefix-reuse", help="KV tiers on multi-turn conversations whose working set outgrows the device pool: hit rates, prefill, TTFT",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--backend", default="auto", help=BACKEND_HELP)
    p.add_argument("--model-shape", choices=MODEL_SHAPES, default="v2-lite",
                   help="the random model's shape (default v2-lite; v41-flash: not built by this benchmark yet)")
    p.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (default: v2-lite all 27, v4-flash as many as fit)")
    p.add_argument("--conversations", type=int, default=32, metavar="C", help="conversations, interleaved round-robin (default 32)")
    p.add_argument("--turns", type=int, default=4, metavar="T", help="turns per conversation (default 4)")
    p.add_argument("--prompt-len", type=int, default=2048, metavar="N", help="turn 1's prompt tokens, random ids (default 2048)")
    p.add_argument("--turn-tokens", type=int, default=256, metavar="N", help="new tokens each later turn appends after the previous output (default 256)")
    p.add_argument("--output-len", type=int, default=64, metavar="N", help="greedy tokens generated per request, EOS ignored (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="requests in flight at most, submitted in round-robin order (default: --conversations, a whole turn's wave)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, metavar="N", help="tokens per engine step (default 8192)")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-kv-blocks", type=int, default=None, metavar="N", help="the device KV pool in blocks")
    pool.add_argument("--kv-cache-gib", type=float, default=None, metavar="GIB", help="the device KV pool in GiB")
    pool.add_argument("--working-set-multiple", type=float, default=None, metavar="X",
                      help="size the device pool so that the working set is X times it (default 4)")
    p.add_argument("--kv-offload-cpu-gib", type=float, default=None, metavar="GIB", help="the host tier (default: the working set's bytes x 1.25)")
    p.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                   help="the disk tier's folder, empty or new (default: a temporary folder, removed at the end)")
    p.add_argument("--kv-offload-disk-gib", type=float, default=None, metavar="GIB", help="the disk tier's bound (default: the working set's bytes x 2)")
    p.add_argument("--configs", default=",".join(CONFIGS), metavar="LIST",
                   help=f"the configurations measured, comma-separated, of {', '.join(CONFIGS)} (default all; restart needs disk)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default=None, help="the KV cache's dtype (default: v2-lite auto, v4-flash fp8)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="batch-invariant kernels (the default): every configuration's greedy tokens must equal the device-only run's; "
                        "--no-deterministic: the backend's fastest kernels (outputs that differ at near-ties are counted)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="warm up each process and capture each engine's graphs before timing (default: where the backend compiles or captures)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write every figure and the machine to FILE")
    add_backend_option_flag(p, "every engine")
    p.set_defaults(func=run_prefix_reuse)


def parse_configs(text: str) -> tuple[str, ...]:
    from deepinfer.bench.prefix_reuse import CONFIGS

    configs = tuple(c.strip() for c in text.split(","))
    if not configs or any(c not in CONFIGS for c in configs) or len(set(configs)) != len(configs):
        raise UserError(f"--configs lists distinct configurations of {', '.join(CONFIGS)}, not {text!r}")
    if "restart" in configs and "disk" not in configs:
        raise UserError("--configs: restart replays the disk tier the disk configuration fills: add disk")
    return configs


def check_args(args: argparse.Namespace) -> tuple[str, ...]:
    """One line for every bad flag, before anything is built; the configurations to measure."""
    from deepinfer.bench import prefix_reuse_model
    from deepinfer.bench.prefix_reuse_model import ModelSpec

    prefix_reuse_model.check_shape(args.model_shape)
    counts = (("--conversations", args.conversations), ("--turns", args.turns), ("--prompt-len", args.prompt_len), ("--output-len", args.output_len),
              ("--max-num-batched-tokens", args.max_num_batched_tokens), ("--max-concurrency", args.max_concurrency), ("--layers", args.layers),
              ("--num-kv-blocks", args.num_kv_blocks))  # fmt: skip
    for name, value in counts:
        if value is not None and value < 1:
            raise UserError(f"{name} must be at least 1, not {value}")
    if args.turn_tokens < 0:
        raise UserError(f"--turn-tokens must be at least 0, not {args.turn_tokens}")
    for name, value in (("--kv-cache-gib", args.kv_cache_gib), ("--working-set-multiple", args.working_set_multiple),
                        ("--kv-offload-cpu-gib", args.kv_offload_cpu_gib), ("--kv-offload-disk-gib", args.kv_offload_disk_gib)):  # fmt: skip
        if value is not None and not value > 0:
            raise UserError(f"{name} must be > 0, not {value}")
    spec = ModelSpec(shape=args.model_shape, config_overrides=None)
    most = prefix_reuse_model.full_layers(spec)
    if args.layers is not None and args.layers > most:
        raise UserError(f"--layers cuts the model: at most {most}, not {args.layers}")
    longest = args.prompt_len + (args.turns - 1) * (args.output_len + args.turn_tokens) + args.output_len
    positions = prefix_reuse_model.max_positions(spec)
    if longest > positions:
        raise UserError(f"the last turn's prompt and output, {longest} tokens, exceed the {args.model_shape} shape's {positions} positions; "
                        "lower --prompt-len / --turns / --turn-tokens / --output-len")  # fmt: skip
    configs = parse_configs(args.configs)
    if args.kv_offload_cpu_gib is not None and not {"host", "disk"} & set(configs):
        raise UserError("--kv-offload-cpu-gib sizes the host and disk configurations' host tier: add host or disk to --configs")
    for flag, value in (("--kv-offload-dir", args.kv_offload_dir), ("--kv-offload-disk-gib", args.kv_offload_disk_gib)):
        if value is not None and "disk" not in configs:
            raise UserError(f"{flag} is the disk configuration's: add disk to --configs")
    if args.kv_offload_dir is not None:
        folder = Path(args.kv_offload_dir).expanduser()
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            raise UserError(f"--kv-offload-dir {folder}: give an empty or new folder (the disk run must start from an empty disk tier)")
    if args.json is not None and not args.json.parent.is_dir():
        raise UserError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    return configs


def run_prefix_reuse(args: argparse.Namespace) -> int:
    configs = check_args(args)
    from deepinfer.bench import prefix_reuse
    from deepinfer.bench.prefix_reuse_model import ModelSpec
    from deepinfer.cli.bench import backend_options, choose_backend
    from deepinfer.plugins import load_plugins

    given = backend_options(args)
    backend = choose_backend(load_plugins(), args.backend)  # one line when it cannot run here
    backend.resolve_options(given)  # unknown options and bad values: one line, before the model is built
    spec = ModelSpec(shape=args.model_shape, backend=backend.name, layers=args.layers, deterministic=args.deterministic,
                     kv_cache_dtype=args.kv_cache_dtype, backend_options=given)  # fmt: skip
    workload = dict(conversations=args.conversations, turns=args.turns, prompt_len=args.prompt_len, turn_tokens=args.turn_tokens,
                    output_len=args.output_len, seed=args.seed)  # fmt: skip
    report = prefix_reuse.run(
        spec, workload, configs, num_kv_blocks=args.num_kv_blocks, kv_cache_gib=args.kv_cache_gib, working_set_multiple=args.working_set_multiple or 4.0,
        max_concurrency=args.max_concurrency, max_num_batched_tokens=args.max_num_batched_tokens, kv_offload_cpu_gib=args.kv_offload_cpu_gib,
        kv_offload_dir=str(Path(args.kv_offload_dir).expanduser()) if args.kv_offload_dir else None, kv_offload_disk_gib=args.kv_offload_disk_gib,
        warmup=args.warmup, json_path=args.json,
    )  # fmt: skip
    print(prefix_reuse.format_report(report))
    notes = prefix_reuse.notes(report)
    for line in notes:
        print(line, file=sys.stderr)
    return 1 if notes and args.deterministic else 0
