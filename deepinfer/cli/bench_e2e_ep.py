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
    p.add_argument("--ep", type=int, default=None, metavar="N",
                   help="devices (one process each) the experts are sharded over (default 1; under torchrun: its process count)")
    p.add_argument("--backend", default="auto", help="auto (cuda, then ascend, then reference), cuda, ascend or reference")
    p.add_argument("--batch", type=int, action="append", default=None, metavar="B", help="requests per rank (repeatable; default 64 and 256)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the cut model (default 4)")
    p.add_argument("--dense-layers", type=int, default=1, help="of which the first this many are dense (default 1)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps timed (default 32)")
    p.add_argument("--num-redundant-experts", type=int, action="append", default=None, metavar="R",
                   help="a variant: R = 0 default placement, R > 0 R extra experts placed by EPLB from a warm-up's load (repeatable; default 0)")
    p.add_argument("--skew", type=float, default=0.5, metavar="S",
                   help="correction bias of the hottest expert; the j-th of a fixed random order gets S*exp(-j/K) (default 0.5; 0: no skew)")
    p.add_argument("--skew-experts", type=float, default=16.0, metavar="K", help="decay length K of the skew, in experts (default 16)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--enforce-eager", action="store_true", help="no device graphs (the cuda backend's CUDA graphs), one rank or several")
    p.add_argument("--interpret", action="store_true", help="run the backend's Triton kernels in the Triton interpreter (CPU; for checking)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, metavar="N", help="prefill tokens per step (default 16384)")
    p.add_argument("--override", action="append", default=None, metavar="KEY=VALUE",
                   help="set a config.json field of the model (JSON value), e.g. hidden_size=1024 (repeatable)")
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
    counts = (
        ("--batch", min(args.batch or [1])), ("--prompt-len", args.prompt_len), ("--new-tokens", args.new_tokens), ("--layers", args.layers),
        ("--max-num-batched-tokens", args.max_num_batched_tokens), ("--repeat", args.repeat),
    )
    for name, value in counts:
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
    from deepinfer.distributed.group import check_timeout

    check_timeout(args.dist_timeout, "--dist-timeout")
    parse_overrides(args.override)


def run(args) -> int:
    from deepinfer.cli.launch import launched_by_torchrun, run_as_rank, torchrun
    from deepinfer.distributed.group import env_rank, env_world_size

    check(args)
    if not launched_by_torchrun():
        check_resources(args)
        if (args.ep or 1) > 1:
            return torchrun(args.ep, ["bench", "e2e-ep", *command_line(args)], what="bench e2e-ep", verbose=getattr(args, "verbose", False))
        return run_rank(args)
    world, rank = env_world_size(), env_rank()
    if args.ep is not None and args.ep != world:
        raise UserError(f"--ep {args.ep}, but torchrun started {world} processes (leave --ep out under torchrun)")
    return run_as_rank(lambda: run_rank(args), rank)


def check_resources(args) -> None:
    """What the ranks need, checked before any starts (one line, exit 2): an accelerator backend
    needs a device per rank; on the CPU (the reference backend, or --interpret) every rank builds
    its share of the model on this host, so the estimate of one rank (the largest variant, from the
    config `run` builds) times the ranks must fit in the RAM available."""
    import torch

    from deepinfer.bench import e2e_ep
    from deepinfer.model.memory import gib, host_available

    spec = _backend(args)
    device = spec.device(args.interpret)
    ranks = args.ep or 1
    have = spec.local_devices(args.interpret)
    if have is not None:
        if have < ranks:
            raise UserError(f"bench e2e-ep --ep {ranks} needs one {device} device per rank, and this host has {have} (backend {spec.name})")
        return
    cfg = e2e_ep.model_config(args.layers, args.dense_layers, parse_overrides(args.override))
    redundant = max(args.num_redundant_experts or [0])
    batch = max(args.batch or [64, 256])
    try:
        per_rank = e2e_ep.rank_memory_bytes(cfg, ranks, redundant, getattr(torch, args.dtype), batch, args.prompt_len, args.new_tokens, int(spec.kv_block_size))
    except ValueError as exc:  # a config the model refuses (--override)
        raise UserError(str(exc)) from None
    free = host_available()
    if free is not None and ranks * per_rank > free:
        raise UserError(
            f"bench e2e-ep on the CPU (backend {spec.name}): {ranks} rank(s) x {gib(per_rank)} (the V3-shaped model of {args.layers} layers, "
            f"{cfg['n_routed_experts']} + {redundant} experts over {ranks}, {args.dtype}, KV cache for batch {batch}) = {gib(ranks * per_rank)}, "
            f"but this host has {gib(free)} of RAM available; lower --layers, --batch or --num-redundant-experts, shrink the model "
            "with --override (e.g. hidden_size=1024), or run it on GPUs"
        )


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
    from deepinfer.distributed.group import env_rank

    if env_rank() == 0:
        print(e2e_ep.format_results(results))
        if any(r.ep > 1 for r in results) and captures_graphs(args):
            print(f"note: {e2e_ep.GRAPHS_NOTE}")
    return 0


def _backend(args):
    """The backend the ranks run (--backend; auto: the available one of highest priority)."""
    from deepinfer.plugins import load_plugins

    plugins = load_plugins()
    return plugins.auto()[0] if args.backend == "auto" else plugins.require(args.backend, args.interpret)


def captures_graphs(args) -> bool:
    """Whether the ranks' backend replays decode steps as device graphs (its capability; never under
    --interpret, where the device is the CPU, as open_runtime gives it)."""
    return _backend(args).graph_capture is not None and not args.interpret


def command_line(args) -> list[str]:
    """The e2e-ep options of `args` as command-line words (those that differ from the defaults)."""
    return launch.command_line(_PARSER, args)
