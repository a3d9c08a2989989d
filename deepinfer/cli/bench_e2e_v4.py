"""`deepinfer bench e2e --model-shape v4-flash`: the arguments of the V4-Flash-shaped decode run,
checked in one line each before anything is built (deepinfer/bench/e2e_v4.py runs it)."""

from __future__ import annotations

import argparse

from deepinfer.errors import UserError

DEFAULT_BATCHES = (1, 64, 256)
DEFAULT_CONTEXTS = (4096, 32768)
DEFAULT_STEPS = 16
DEFAULT_KV_CACHE_DTYPE = "fp8"


def v4_arguments(args: argparse.Namespace) -> dict:
    """The keyword arguments of e2e_v4.run from the command line (the defaults filled in); one
    UserError line for a bad value."""
    from deepinfer.bench.e2e_v4 import FULL_LAYERS, V4_FLASH, model_len

    positions = V4_FLASH["max_position_embeddings"]
    if args.prompt_len is not None:
        raise UserError("--prompt-len is for the v2-lite shape; --model-shape v4-flash takes --context (tokens cached when decoding starts)")
    batches = tuple(args.batch or DEFAULT_BATCHES)
    contexts = tuple(args.context or DEFAULT_CONTEXTS)
    steps = DEFAULT_STEPS if args.new_tokens is None else args.new_tokens
    layers = 1 if args.layers is None else args.layers
    for name, value in (("--batch", min(batches)), ("--context", min(contexts)), ("--new-tokens", steps), ("--layers", layers)):
        if value < 1:
            raise UserError(f"{name} must be at least 1, not {value}")
    if args.layers is not None and args.layers > FULL_LAYERS:
        raise UserError(f"--layers cuts the model: at most {FULL_LAYERS} (V4-Flash), not {args.layers}")
    if model_len(contexts, steps * (2 if args.profile else 1)) > positions:
        profiled = " (twice with --profile: the profiled steps follow the timed ones)" if args.profile else ""
        raise UserError(f"--context {max(contexts)} + --new-tokens {steps}{profiled} exceeds V4-Flash's {positions} positions")
    if args.json is not None and not args.json.parent.exists():
        raise UserError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    return dict(batches=batches, contexts=contexts, steps=steps, layers=args.layers, kv_cache_dtype=args.kv_cache_dtype or DEFAULT_KV_CACHE_DTYPE,
                json_path=args.json, profile_rows=args.profile_rows if args.profile else 0, enforce_eager=args.enforce_eager)  # fmt: skip


def run_e2e_v4(args: argparse.Namespace) -> int:
    from deepinfer.bench import e2e_v4
    from deepinfer.cli.bench import backend_options, choose_backend
    from deepinfer.plugins import load_plugins

    given = backend_options(args)
    kwargs = v4_arguments(args)
    spec = choose_backend(load_plugins(), args.backend)  # one line when it cannot run here
    spec.resolve_options(given)  # unknown options and bad values: one line, before the model is built
    results, info = e2e_v4.run(spec.name, backend_options=given, **kwargs)
    print(e2e_v4.format_results(results, info))
    return 0
