"""`deepinfer bench ops [--backend NAME] [--op OP] [--backend-option KEY=VALUE] [--json FILE] [--plot FILE.png]`:
benchmark a backend's ops.

Speed is measured here, never asserted in tests. A backend that declares a bench runner
(`BackendSpec.bench_runner`, "module:function") gets its own benchmarks: the machine's ceilings,
each op at the shapes that matter and its torch peer, in one run (the cuda backend's does). Any
other backend is timed over the golden inputs of its conformance cases (warm-up, then the median of
repeated runs, synchronising the device around each), and the table gives the time per call.
With --ep N: dispatch/combine across N ranks (deepinfer.cli.bench_ops_ep).

--backend-option reaches the kernel choice of the conformance-case timing and of --ep N; a backend's
own bench runner takes no options (it times the kernels it names), so options given for one are an error.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from pathlib import Path

from deepinfer.errors import UserError


def add_parser(what) -> None:
    from deepinfer.cli import bench_ops_ep
    from deepinfer.cli.bench import BACKEND_HELP, add_backend_option_flag

    ops = what.add_parser(
        "ops",
        help="benchmark the ops of a backend (its own bench runner, else the conformance cases' inputs)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ops.add_argument("--backend", default="auto", help=f"whose ops to time: {BACKEND_HELP}")
    ops.add_argument("--op", action="append", default=None, help="only this op (repeatable)")
    ops.add_argument("--repeat", type=int, default=10, help="timed runs per case (conformance-case timing only; default 10)")
    ops.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results to FILE")
    ops.add_argument("--plot", type=Path, default=None, metavar="FILE", help="plot the fraction of the ceiling per case to FILE.png (backend runners only)")
    add_backend_option_flag(ops, "the kernels timed (conformance-case timing and --ep N; not a backend's own bench runner)")
    bench_ops_ep.add_arguments(ops)  # --ep N: dispatch/combine across N ranks (torchrun)
    ops.set_defaults(func=run_ops)


def bench_runner(spec):
    """The function named by the backend's `bench_runner` ("module:function"), or None when it has none."""
    if not spec.bench_runner:
        return None
    module_name, _, func_name = spec.bench_runner.partition(":")
    try:
        return getattr(importlib.import_module(module_name), func_name or "run")
    except Exception as exc:  # a broken runner is the backend's bug: say so in one line
        raise UserError(f"backend {spec.name!r}: its bench runner {spec.bench_runner!r} failed to load: {type(exc).__name__}: {exc}") from None


def _sync(device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    import torch

    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def run_ops(args: argparse.Namespace) -> int:
    import torch

    from deepinfer.cli import bench_ops_ep
    from deepinfer.cli.bench import backend_options, choose_backend
    from deepinfer.plugins import load_plugins
    from deepinfer.registry import ResolveContext, all_ops
    from deepinfer_conformance.golden_io import GoldenTensors, read_cases
    from deepinfer_conformance.worker import to_device

    given = backend_options(args)  # a malformed KEY=VALUE is one line before anything runs
    plugins = load_plugins()
    if bench_ops_ep.wants_ep(args):
        if args.backend == "auto":  # the ranks get the chosen name (bench_ops_ep checks it can run)
            args.backend = choose_backend(plugins, "auto").name
        return bench_ops_ep.run(args)
    if args.repeat < 1:
        raise UserError(f"--repeat must be at least 1, not {args.repeat}")
    ops = all_ops()
    unknown = set(args.op or []) - set(ops)
    if unknown:
        raise UserError(f"unknown op(s) {', '.join(sorted(unknown))}; ops: {', '.join(ops)}")
    for path in (args.json, args.plot):
        if path is not None and not path.parent.exists():
            raise UserError(f"cannot write {path}: folder {path.parent} does not exist")
    spec = choose_backend(plugins, args.backend)
    options = spec.resolve_options(given)  # unknown options and bad values: one line
    runner = bench_runner(spec)
    if runner is not None:
        if given:
            raise UserError(f"backend {spec.name!r}: its bench runner ({spec.bench_runner}) takes no backend options, so "
                            f"--backend-option {' '.join(f'{k}={v}' for k, v in given.items())} would not reach it; "
                            "`bench ops --ep N` and `bench e2e` take them")
        runner(ops=args.op, json_path=args.json, plot_path=args.plot)
        return 0
    if args.plot is not None:
        raise UserError(f"--plot needs a backend bench runner; backend {spec.name!r} has none (only conformance-case timing)")
    device = torch.device(spec.device())
    registry = plugins.registry(spec.name, options=options)
    golden = GoldenTensors()
    results = []
    for case in read_cases():
        if args.op and case.op not in args.op:
            continue
        kernel = registry.choose(ResolveContext(spec.name, device, case.torch_dtype, options=options), case.op, case.fmt)
        if kernel is None:
            results.append({"case": case.id, "status": "missing"})
            continue
        kwargs = to_device(golden.inputs(case), device)
        times = []
        for i in range(args.repeat + 2):
            _sync(device)
            start = time.perf_counter()
            kernel.fn(**kwargs)
            _sync(device)
            if i >= 2:
                times.append(time.perf_counter() - start)
        results.append({"case": case.id, "status": "ok", "median_us": statistics.median(times) * 1e6, "kernel": kernel.note})
    width = max((len(r["case"]) for r in results), default=4)
    for r in results:
        value = f"{r['median_us']:10.1f} us  {r['kernel']}" if r["status"] == "ok" else "   missing"
        print(f"{r['case']:<{width}}  {value}")
    if args.json is not None:
        report = {"backend": spec.name, "backend_options": options, "device": str(device), "torch": torch.__version__, "results": results}
        args.json.write_text(json.dumps(report, indent=1))
    return 0
