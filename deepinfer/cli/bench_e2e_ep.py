"""`deepinfer bench e2e-ep --ep N`: decode tokens/s of a random DeepSeek-V3-shaped model, experts over N devices.

One process per device: with --ep N > 1 (and not already under torchrun) it starts
`torchrun --standalone --nproc-per-node N -m deepinfer bench e2e-ep ...` with the same options
(deepinfer.cli.launch, as `deepinfer run --ep N` does). Every rank decodes its own --batch requests (attention data
parallel); the 256 routed experts of every MoE layer are sharded over the N ranks. Each
--num-redundant-experts value is one variant: 0 keeps the default placement, R > 0 adds R copies of
busy experts placed by EPLB from the load of a warm-up run. --skew makes the routing skewed on
purpose (a correction bias favouring a few experts). Rank 0 prints the table and writes --json.
See deepinfer/bench/e2e_ep.py for what is measured and how.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from deepinfer.cli import launch
from deepinfer.errors import UserError

_PARSER: argparse.ArgumentParser | None = None
DTYPES = ("bfloat16", "float16", "float32")


def add_parser(what) -> None:
    """Add `e2e-ep` to the `deepinfer bench` subcommands."""
    global _PARSER
    p = what.add_parser(
        "e2e-ep",
        help="expert-parallel scaling: decode tok/s of a random DeepSeek-V3-shaped model over --ep N devices (skewed routing, EPLB)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ep", type=int, default=None, metavar="N", help="devices (one process each) the experts are sharded over (default 1; under torchrun: its process count)")
    p.add_argument("--backend", default="auto", help="auto (cuda, then ascend, then reference), cuda, ascend or reference")
    p.add_argument("--batch", type=int, action="append", default=None, metavar="B", help="requests per rank (repeatable; default 64 and 256)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the cut model (default 4)")
    p.add_argument("--dense-layers", type=int, default=1, help="of which the first this many are dense (default 1)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps timed (default 32)")
    p.add_argument("--num-redundant-experts", type=int, action="append", default=None, metavar="R", help="a variant: R = 0 default placement, R > 0 R extra experts placed by EPLB from a warm-up's load (repeatable; default 0)")
    p.add_argument("--skew", type=float, default=0.5, metavar="S", help="correction bias of the hottest expert; the j-th of a fixed random order gets S*exp(-j/K) (default 0.5; 0: no skew)")
    p.add_argument("--skew-experts", type=float, default=16.0, metavar="K", help="decay length K of the skew, in experts (default 16)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (one rank or several)")
    p.add_argument("--interpret", action="store_true", help="run the backend's Triton kernels in the Triton interpreter (CPU; for checking)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, metavar="N", help="prefill tokens per step (default 16384)")
    p.add_argument("--override", action="append", default=None, metavar="KEY=VALUE", help="set a config.json field of the model (JSON value), e.g. hidden_size=1024 (repeatable)")
    p.add_argument("--repeat", type=int, default=2, help="timed runs of each call; the fastest counts (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dist-timeout", type=float, default=300.0, metavar="S", help="seconds a rank waits in a collective (default 300)")
    p.add_argument("--json", type=Path, default=None, help="write the results to FILE (rank 0)")
    p.set_defaults(func=run)
    _PARSER = p


def parse_overrides(items: list[str] | None) -> dict:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--override {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def check(args) -> None:
    for name, value in (("--batch", min(args.batch or [1])), ("--prompt-len", args.prompt_len), ("--new-tokens", args.new_tokens), ("--layers", args.layers), ("--max-num-batched-tokens", args.max_num_batched_tokens), ("--repeat", args.repeat)):
        if value < 1:
            raise UserError(f"{name} must be at least 1, not {value}")
    if args.ep is not None and args.ep < 1:
        raise UserError(f"--ep must be >= 1, got {args.ep}")
    if not 0 <= args.dense_layers < args.layers:
        raise UserError(f"--dense-layers must lie in [0, --layers), got {args.dense_layers} of {args.layers}: the cut model needs a MoE layer")
    if args.skew < 0 or args.skew_experts <= 0:
        raise UserError("--skew must be >= 0 and --skew-experts > 0")
    if any(r < 0 for r in args.num_redundant_experts or []):
        raise UserError("--num-redundant-experts must be >= 0")
    if args.json is not None and not args.json.parent.exists():
        raise UserError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    parse_overrides(args.override)


def run(args) -> int:
    from deepinfer.cli.launch import launched_by_torchrun, torchrun

    check(args)
    if not launched_by_torchrun():
        if (args.ep or 1) > 1:
            return torchrun(args.ep, ["bench", "e2e-ep", *command_line(args)], what="bench e2e-ep", verbose=getattr(args, "verbose", False))
    elif args.ep is not None and args.ep != int(os.environ["WORLD_SIZE"]):
        raise UserError(f"--ep {args.ep}, but torchrun started {os.environ['WORLD_SIZE']} processes (leave --ep out under torchrun)")
    return run_rank(args)


def run_rank(args) -> int:
    import torch

    from deepinfer.bench import e2e_ep

    dtype = getattr(torch, args.dtype)
    try:
        results = e2e_ep.run(
            backend=args.backend,
            batches=tuple(args.batch or (64, 256)),
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            layers=args.layers,
            dense_layers=args.dense_layers,
            redundant=tuple(args.num_redundant_experts or (0,)),
            skew=args.skew,
            skew_experts=args.skew_experts,
            dtype=dtype,
            enforce_eager=args.enforce_eager,
            interpret=args.interpret,
            config_overrides=parse_overrides(args.override),
            max_num_batched_tokens=args.max_num_batched_tokens,
            repeat=args.repeat,
            seed=args.seed,
            dist_timeout=args.dist_timeout,
            json_path=args.json,
            progress=lambda line: print(line, flush=True),
        )
    except ValueError as exc:  # sizes that do not divide, a config the model refuses
        raise UserError(str(exc)) from None
    if int(os.environ.get("RANK", "0")) == 0:
        print(e2e_ep.format_results(results))
        if any(r.ep > 1 for r in results) and torch.cuda.is_available():
            print(f"note: {e2e_ep.GRAPHS_NOTE}")
    return 0


def command_line(args) -> list[str]:
    """The e2e-ep options of `args` as command-line words (those that differ from the defaults)."""
    return launch.command_line(_PARSER, args)
