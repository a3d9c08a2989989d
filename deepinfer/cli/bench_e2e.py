"""`deepinfer bench e2e`: decode step time of a random DeepSeek-V2-Lite-shaped model, against its floor
and against HF transformers running the very same weights on the same device.

The floor is the bytes a decode step must read over the copy bandwidth measured in the same run
(deepinfer/bench/e2e.py says how). It runs on any available backend's device; before building the
model it checks that the model, its KV cache and the bandwidth test fit in the device's free memory
(the full 27 layers need at least 71 GiB: on a smaller device, or the CPU, cut it with --layers).
`--backend-option KEY=VALUE` reaches deepinfer's side as `deepinfer run --backend-option` does.

`--model-shape v4-flash`: a random DeepSeek-V4-Flash-shaped model instead (fp8_block projections,
mxfp4 experts, --kv-cache-dtype fp8 by default), cut to the layers that fit, decoding from each
--context (default 4096 and 32768) at each --batch (default 1, 64, 256), against its memory floor;
then prefilling each --prefill row (default 8x8192 and 1x65536: prompts x tokens) in chunks of
--prefill-chunk tokens (default the engine's: 16384 on an accelerator with at least 70 GiB, else 8192), against its compute floor (the FLOPs over the bf16 / fp8
matmul rates measured in the same run); --no-prefill / --no-decode skip either; no HF peer
(deepinfer/bench/e2e_v4.py and v4_prefill_floor.py say how).

`--model-shape v41-flash`: a random DeepSeek-V4.1-Flash-shaped model (mxfp4 experts, its caches in the
release's formats), cut to the layers that fit, with v4-flash's decode and prefill rows (the prefill floor
over the bf16 rate alone) and the cache bytes held per token of history and per request
(deepinfer/bench/e2e_v41.py and v41_flash.py say how).

`--profile`: after the timing, deepinfer's decode step under torch's profiler, its kernels by time per
step (deepinfer/bench/step_profile.py); with v4-flash, also one more pass of each prefill row. `--deterministic-cost` (v2-lite): deepinfer's side built in
both modes over the same weights in one process, taking turns --repeat times; each mode's median step
and deterministic mode's cost (deepinfer/bench/deterministic_cost.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer.errors import UserError

MODEL_SHAPES = ("v2-lite", "v4-flash", "v41-flash")


def add_parser(what) -> None:
    from deepinfer.cli.bench import BACKEND_HELP, add_backend_option_flag

    e2e = what.add_parser(
        "e2e",
        help="decode step time of a random DeepSeek-V2-Lite- (or V4-Flash-, V4.1-Flash-) shaped model vs its floor (and HF transformers)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e2e.add_argument("--backend", default="auto", help=f"the backend that runs deepinfer's side: {BACKEND_HELP}")
    e2e.add_argument("--model-shape", choices=MODEL_SHAPES, default=MODEL_SHAPES[0], help="the model's shape (default v2-lite)")
    e2e.add_argument("--batch", type=int, action="append", default=None, help="batch size (repeatable; default 1 and 64; v4-flash: 1, 64 and 256)")
    e2e.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (default: all 27; v4-flash: as many as fit)")
    e2e.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per request (default 128; v2-lite only)")
    e2e.add_argument("--new-tokens", type=int, default=None, help="decode steps timed (default 64; v4-flash: 16)")
    e2e.add_argument("--no-hf", action="store_true", help="skip the transformers peer (v4-flash has none)")
    e2e.add_argument("--context", type=int, action="append", default=None,
                     help="v4-flash: tokens in each request's cache when decoding starts (repeatable; default 4096 and 32768)")
    e2e.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default=None, help="v4-flash: the KV cache's dtype (default fp8; auto: the model's)")
    e2e.add_argument("--prefill", action="append", default=None, metavar="PROMPTSxTOKENS",
                     help="v4-flash: a prefill row, PROMPTS prompts of TOKENS tokens each, chunked (repeatable; default 8x8192 and 1x65536)")
    e2e.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                     help="v4-flash: the prefill rows' max_num_batched_tokens, the most tokens one step computes "
                          "(default the engine's: 16384 on an accelerator with at least 70 GiB, else 8192)")
    e2e.add_argument("--no-prefill", action="store_true", help="v4-flash: skip the prefill rows")
    e2e.add_argument("--no-decode", action="store_true", help="v4-flash: skip the decode rows (only the prefill rows)")
    e2e.add_argument("--deterministic", action="store_true",
                     help="v2-lite: deepinfer's side in deterministic mode (batch-invariant kernels); compare with a run without it for the cost")
    e2e.add_argument("--deterministic-cost", action="store_true",
                     help="v2-lite: both modes in one process, alternated --repeat times: each mode's median ms/step and the cost (no HF peer)")
    e2e.add_argument("--repeat", type=int, default=None, help="--deterministic-cost: rounds of the two modes (default 5)")
    e2e.add_argument("--enforce-eager", action="store_true", help="v4-flash: every decode step eagerly, without device graphs (the graphs' baseline)")
    e2e.add_argument("--no-overlap", action="store_true", help="each decode step waits for the one before (default: overlap scheduling on cuda and ascend)")
    e2e.add_argument("--profile", action="store_true",
                     help="after the timing, profile the decode step (v4-flash: and each prefill row): kernels by time and the device's idle share")
    e2e.add_argument("--profile-rows", type=int, default=20, metavar="N", help="--profile: kernels listed per batch (default 20)")
    e2e.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results to FILE")
    add_backend_option_flag(e2e, "deepinfer's side")
    e2e.set_defaults(func=run_e2e)


def run_e2e(args: argparse.Namespace) -> int:
    check_modes(args)
    if args.model_shape in ("v4-flash", "v41-flash"):
        from deepinfer.cli.bench_e2e_v4 import run_e2e_v4, run_e2e_v41

        if args.deterministic:
            raise UserError(f"--deterministic is for --model-shape v2-lite (the {args.model_shape} run has no deterministic variant yet)")
        return run_e2e_v4(args) if args.model_shape == "v4-flash" else run_e2e_v41(args)
    v4_only = {
        "--context": (args.context, "the v2-lite run takes --prompt-len"),
        "--kv-cache-dtype": (args.kv_cache_dtype, "the v2-lite run takes the model dtype's cache"),
        "--enforce-eager": (args.enforce_eager or None, "the v2-lite run compares with HF transformers, with device graphs where the backend has them"),
        "--prefill": (args.prefill, "the v2-lite run times decode steps only"),
        "--prefill-chunk": (args.prefill_chunk, "the v2-lite run times decode steps only"),
        "--no-prefill": (args.no_prefill or None, "the v2-lite run has no prefill rows"),
        "--no-decode": (args.no_decode or None, "the v2-lite run times decode steps only"),
    }
    for flag, (value, why) in v4_only.items():
        if value is not None:
            raise UserError(f"{flag} is for --model-shape v4-flash ({why})")
    from deepinfer.bench import e2e
    from deepinfer.cli.bench import backend_options, choose_backend
    from deepinfer.plugins import load_plugins

    given = backend_options(args)
    args.prompt_len = 128 if args.prompt_len is None else args.prompt_len
    args.new_tokens = 64 if args.new_tokens is None else args.new_tokens
    batches = tuple(args.batch or (1, 64))
    for name, value in (("--batch", min(batches)), ("--prompt-len", args.prompt_len), ("--new-tokens", args.new_tokens), ("--layers", args.layers or 1)):
        if value < 1:
            raise UserError(f"{name} must be at least 1, not {value}")
    if args.layers is not None and args.layers > e2e.V2_LITE["num_hidden_layers"]:
        raise UserError(f"--layers cuts the model: at most {e2e.V2_LITE['num_hidden_layers']}, not {args.layers}")
    context = args.prompt_len + args.new_tokens + 1
    if context > e2e.V2_LITE["max_position_embeddings"]:
        raise UserError(f"--prompt-len + --new-tokens + 1 = {context} exceeds the model's {e2e.V2_LITE['max_position_embeddings']} positions")
    if args.json is not None and not args.json.parent.exists():
        raise UserError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    spec = choose_backend(load_plugins(), args.backend)  # one line when it cannot run here
    spec.resolve_options(given)  # unknown options and bad values: one line, before the model is built
    overlap = False if args.no_overlap else None
    if args.deterministic_cost:
        from deepinfer.bench import deterministic_cost

        costs = deterministic_cost.run(spec.name, batches, args.prompt_len, args.new_tokens, args.layers, args.repeat or 5, args.json,
                                       backend_options=given, overlap=overlap)  # fmt: skip
        print(deterministic_cost.format_results(costs))
        return 0
    results = e2e.run(spec.name, batches, args.prompt_len, args.new_tokens, args.layers, with_hf=not args.no_hf, json_path=args.json,
                      backend_options=given, deterministic=args.deterministic, overlap=overlap, profile_rows=args.profile_rows if args.profile else 0)
    print(e2e.format_results(results))
    return 0


def check_modes(args: argparse.Namespace) -> None:
    """One line for a combination of --profile, --deterministic-cost and --repeat that means nothing."""
    if args.profile_rows < 1:
        raise UserError(f"--profile-rows must be at least 1, not {args.profile_rows}")
    if args.repeat is not None and not args.deterministic_cost:
        raise UserError("--repeat counts the rounds of --deterministic-cost")
    if args.repeat is not None and args.repeat < 1:
        raise UserError(f"--repeat must be at least 1, not {args.repeat}")
    if not args.deterministic_cost:
        return
    if args.model_shape in ("v4-flash", "v41-flash"):
        raise UserError(f"--deterministic-cost is for --model-shape v2-lite (the {args.model_shape} run has no deterministic variant yet)")
    if args.deterministic:
        raise UserError("--deterministic-cost runs both modes itself: leave out --deterministic")
    if args.profile:
        raise UserError("--deterministic-cost and --profile are separate runs: profile each mode with --profile (and --deterministic)")
