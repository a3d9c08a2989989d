"""`deepinfer bench e2e --model-shape v4-flash | v41-flash`: the arguments of the V4-Flash- (V4.1-Flash-) shaped
decode and prefill run, checked in one line each before anything is built (deepinfer/bench/e2e_v4.py and
e2e_v41.py run them)."""

from __future__ import annotations

import argparse
import re

from deepinfer.errors import UserError

DEFAULT_BATCHES = (1, 64, 256)
DEFAULT_CONTEXTS = (4096, 32768)
DEFAULT_STEPS = 16
DEFAULT_KV_CACHE_DTYPE = "fp8"


def parse_prefill(word: str) -> tuple[int, int]:
    """`--prefill PROMPTSxTOKENS` as (prompts, tokens); one UserError line when it is not that."""
    match = re.fullmatch(r"(\d+)[xX](\d+)", word.strip())
    if match is None:
        raise UserError(f"--prefill takes PROMPTSxTOKENS, prompts of tokens each (e.g. 8x8192), not {word!r}")
    prompts, tokens = int(match[1]), int(match[2])
    if prompts < 1 or tokens < 1:
        raise UserError(f"--prefill {word}: prompts and tokens must both be at least 1")
    return prompts, tokens


def v4_arguments(args: argparse.Namespace, shape: str = "V4-Flash") -> dict:
    """The keyword arguments of e2e_v4.run (e2e_v41.run for `shape` "V4.1-Flash", which takes no kv_cache_dtype)
    from the command line (the defaults filled in); one UserError line for a bad value."""
    from deepinfer.bench import v41_flash
    from deepinfer.bench.e2e_v4 import DEFAULT_PREFILLS, FULL_LAYERS, V4_FLASH, model_len

    v41 = shape == "V4.1-Flash"
    positions, most = (v41_flash.POSITIONS, v41_flash.FULL_LAYERS) if v41 else (V4_FLASH["max_position_embeddings"], FULL_LAYERS)
    if args.prompt_len is not None:
        raise UserError(f"--prompt-len is for the v2-lite shape; --model-shape {args.model_shape} takes --context (tokens cached when decoding starts)")
    if v41 and (args.kv_cache_dtype is not None or args.profile or args.enforce_eager):
        flag = "--kv-cache-dtype" if args.kv_cache_dtype is not None else "--profile" if args.profile else "--enforce-eager"
        raise UserError(f"{flag} is for --model-shape v4-flash (V4.1's caches have the release's formats, and its run has no graphs or profile yet)")
    if args.no_decode and args.no_prefill:
        raise UserError("--no-decode and --no-prefill leave nothing to run: drop one")
    decode_flags = {"--batch": args.batch, "--context": args.context, "--new-tokens": args.new_tokens, "--enforce-eager": args.enforce_eager or None}
    given = [flag for flag, value in decode_flags.items() if value is not None]
    if args.no_decode and given:
        raise UserError(f"--no-decode skips the decode rows: leave out {given[0]} (it sets them)")
    prefill_flags = [flag for flag, value in (("--prefill", args.prefill), ("--prefill-chunk", args.prefill_chunk)) if value is not None]
    if args.no_prefill and prefill_flags:
        raise UserError(f"--no-prefill skips the prefill rows: leave out {prefill_flags[0]} (it sets them)")
    batches = () if args.no_decode else tuple(args.batch or DEFAULT_BATCHES)
    contexts = () if args.no_decode else tuple(args.context or DEFAULT_CONTEXTS)
    steps = DEFAULT_STEPS if args.new_tokens is None else args.new_tokens
    layers = 1 if args.layers is None else args.layers
    chunk = args.prefill_chunk  # None: the engine's default on the device
    for name, value in (("--batch", min(batches, default=1)), ("--context", min(contexts, default=1)), ("--new-tokens", steps), ("--layers", layers),
                        ("--prefill-chunk", 1 if chunk is None else chunk)):  # fmt: skip
        if value < 1:
            raise UserError(f"{name} must be at least 1, not {value}")
    if args.layers is not None and args.layers > most:
        raise UserError(f"--layers cuts the model: at most {most} ({shape}), not {args.layers}")
    if contexts and model_len(contexts, steps * (2 if args.profile else 1)) > positions:
        profiled = " (twice with --profile: the profiled steps follow the timed ones)" if args.profile else ""
        raise UserError(f"--context {max(contexts)} + --new-tokens {steps}{profiled} exceeds {shape}'s {positions} positions")
    prefills = () if args.no_prefill else tuple(parse_prefill(word) for word in args.prefill) if args.prefill else DEFAULT_PREFILLS
    for prompts, tokens in prefills:
        if tokens + 1 > positions:
            raise UserError(f"--prefill {prompts}x{tokens}: {tokens} tokens and the one sampled exceed {shape}'s {positions} positions")
    if args.json is not None and not args.json.parent.exists():
        raise UserError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    if v41:
        return dict(batches=batches, contexts=contexts, steps=steps, layers=args.layers, json_path=args.json, prefills=prefills, prefill_chunk=chunk)
    return dict(batches=batches, contexts=contexts, steps=steps, layers=args.layers, kv_cache_dtype=args.kv_cache_dtype or DEFAULT_KV_CACHE_DTYPE,
                json_path=args.json, profile_rows=args.profile_rows if args.profile else 0, enforce_eager=args.enforce_eager,
                prefills=prefills, prefill_chunk=chunk)  # fmt: skip


def run_e2e_v4(args: argparse.Namespace) -> int:
    from deepinfer.bench import e2e_v4
    from deepinfer.cli.bench import backend_options, choose_backend
    from deepinfer.plugins import load_plugins

    given = backend_options(args)
    kwargs = v4_arguments(args)
    spec = choose_backend(load_plugins(), args.backend)  # one line when it cannot run here
    spec.resolve_options(given)  # unknown options and bad values: one line, before the model is built
    results, prefill, info = e2e_v4.run(spec.name, backend_options=given, **kwargs)
    print(e2e_v4.format_results(results, info, prefill))
    return 0


def run_e2e_v41(args: argparse.Namespace) -> int:
    from deepinfer.bench import e2e_v41
    from deepinfer.cli.bench import backend_options, choose_backend
    from deepinfer.plugins import load_plugins

    given = backend_options(args)
    kwargs = v4_arguments(args, "V4.1-Flash")
    spec = choose_backend(load_plugins(), args.backend)
    spec.resolve_options(given)
    results, prefill, info = e2e_v41.run(spec.name, backend_options=given, **kwargs)
    print(e2e_v41.format_results(results, info, prefill))
    return 0
