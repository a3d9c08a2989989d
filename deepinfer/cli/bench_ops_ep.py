"""`deepinfer bench ops --ep N`: the expert-parallel dispatch/combine benchmark (deepinfer.bench.ep).

Outside torchrun, checks the request (one-line errors, exit code 2: the backend, its options, a
device per rank as the backend counts them) and starts N ranks on this host with torchrun
(`deepinfer.cli.launch`, as `deepinfer run --ep N`), each running the same command; under
torchrun, runs this rank's part. On a CPU machine it runs over gloo with the
reference backend, or the cuda backend's kernels under TRITON_INTERPRET=1 (use small --tokens).
`--backend-option KEY=VALUE` (e.g. the cuda backend's ep_path) chooses the EP paths measured.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from deepinfer.errors import UserError

EP_OPS = ("dispatch", "combine")


def add_arguments(ops: argparse.ArgumentParser) -> None:
    group = ops.add_argument_group("expert parallelism (dispatch / combine across ranks; see docs/distributed.md)")
    group.add_argument("--ep", type=int, default=None, metavar="N", help="benchmark dispatch/combine over N ranks of this host, one process each (torchrun)")
    group.add_argument("--tokens", type=int, action="append", default=None, metavar="T", help="tokens per rank (repeatable; default 128 and 4096)")
    group.add_argument("--warmup", type=int, default=3, metavar="N", help="untimed iterations first (default 3)")
    group.add_argument("--phases", action="store_true",
                       help="also time each phase of every EP implementation's dispatch / combine (device events)")
    group.add_argument("--dist-timeout", type=float, default=300.0, metavar="S", help="seconds (> 0) a rank waits in a collective (default 300)")


def wants_ep(args) -> bool:
    return getattr(args, "ep", None) is not None and args.ep != 1


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check(args) -> None:
    """Refuse what cannot run, before any rank starts."""
    import torch

    from deepinfer.cli.bench import backend_options
    from deepinfer.distributed.group import check_timeout
    from deepinfer.plugins import BackendError, load_plugins

    if args.ep < 1:
        raise UserError(f"--ep must be >= 1, got {args.ep}")
    other = sorted(set(args.op or []) - set(EP_OPS))
    if other:
        raise UserError(f"with --ep only dispatch and combine are benchmarked, not {', '.join(other)}")
    if args.plot is not None:
        raise UserError("--plot is not available with --ep")
    if args.repeat < 1 or args.warmup < 0:
        raise UserError("--repeat must be >= 1 and --warmup >= 0")
    if any(t < 0 for t in args.tokens or []):
        raise UserError("--tokens must be >= 0")
    check_timeout(args.dist_timeout, "--dist-timeout")  # seconds in (0, max], as `run` checks it
    if args.json is not None and not Path(args.json).parent.exists():
        raise UserError(f"cannot write {args.json}: folder {Path(args.json).parent} does not exist")
    interpret = interpreting()
    plugins = load_plugins()
    spec = plugins.backend(args.backend)
    options = spec.resolve_options(backend_options(args))  # unknown options and bad values: one line
    try:
        plugins.require(args.backend, interpret=interpret)
    except BackendError as exc:
        if not interpret and plugins.probe(args.backend, interpret=True).available:
            raise BackendError(f"{exc} (on a CPU: TRITON_INTERPRET=1 runs its Triton kernels in the interpreter, or --backend reference)") from None
        raise
    devices = spec.local_devices(interpret)
    if devices is None:  # the CPU: one process per rank
        if args.ep > (os.cpu_count() or 1):
            raise UserError(f"--ep {args.ep} on the CPU starts {args.ep} processes; this machine has {os.cpu_count()} CPUs")
    elif args.ep > devices:
        raise UserError(
            f"--ep {args.ep} with backend {args.backend!r} needs {args.ep} {spec.device_type} devices (one rank each); this host has {devices or 'none'}"
        )
    from deepinfer.bench.ep import ep_implementations

    registry = plugins.registry(args.backend, interpret=interpret, options=options)
    if not ep_implementations(registry, args.backend, torch.device(spec.device(interpret)), args.ep, options):
        raise UserError(f"backend {args.backend!r} has no expert-parallel dispatch/combine (no kernel for ep_size {args.ep})")


def command_line(args) -> list[str]:
    words = ["bench", "ops", "--backend", args.backend, "--ep", str(args.ep), "--repeat", str(args.repeat), "--warmup", str(args.warmup),
             "--dist-timeout", str(args.dist_timeout)]
    for op in args.op or []:
        words += ["--op", op]
    for t in args.tokens or []:
        words += ["--tokens", str(t)]
    if args.json is not None:
        words += ["--json", str(Path(args.json).resolve())]
    if getattr(args, "phases", None):
        words += ["--phases"]
    for option in args.backend_option or []:
        words += ["--backend-option", option]
    return words


def run(args) -> int:
    from deepinfer.cli.launch import launched_by_torchrun, torchrun

    if not launched_by_torchrun():
        check(args)
        return torchrun(args.ep, command_line(args), what="bench ops", verbose=getattr(args, "verbose", False))
    world = int(os.environ["WORLD_SIZE"])
    if args.ep != world:
        raise UserError(f"--ep {args.ep}, but torchrun started {world} processes")
    from deepinfer.bench import ep
    from deepinfer.cli.bench import backend_options

    ep.run_rank(
        backend=args.backend,
        interpret=interpreting(),
        ops=list(args.op or EP_OPS),
        tokens=list(args.tokens or ep.DEFAULT_TOKENS),
        repeat=args.repeat,
        warmup=args.warmup,
        timeout_s=args.dist_timeout,
        json_path=Path(args.json) if args.json is not None else None,
        progress=lambda line: print(line, flush=True),
        phases=bool(args.phases),
        backend_options=backend_options(args),
    )
    return 0
