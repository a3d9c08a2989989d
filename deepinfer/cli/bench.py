"""`deepinfer bench ops --backend NAME [--op OP] [--json FILE]`: time each op at its conformance shapes.

Speed is measured here, never asserted in tests. Each op runs over the golden inputs of its cases
(warm-up, then the median of repeated runs, synchronising the device around each), and the table
gives the time per call. Ceilings and torch peers per op come with the kernels of each backend.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from deepinfer.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (results go to files, never to test asserts)", description=__doc__)
    what = p.add_subparsers(dest="what", metavar="WHAT", parser_class=type(p))
    ops = what.add_parser("ops", help="time every op of a backend at the conformance shapes")
    ops.add_argument("--backend", default="reference")
    ops.add_argument("--op", action="append", default=None, help="only this op (repeatable)")
    ops.add_argument("--repeat", type=int, default=10)
    ops.add_argument("--json", type=Path, default=None, help="write the results to FILE")
    ops.set_defaults(func=run_ops)
    p.set_defaults(func=lambda args: (_ for _ in ()).throw(UserError("say what to benchmark: `deepinfer bench ops --backend NAME`")))


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def run_ops(args: argparse.Namespace) -> int:
    from deepinfer.plugins import load_plugins
    from deepinfer.registry import ResolveContext, all_ops
    from deepinfer_conformance.golden_io import GoldenTensors, read_cases
    from deepinfer_conformance.worker import to_device

    if args.repeat < 1:
        raise UserError(f"--repeat must be at least 1, not {args.repeat}")
    if args.json is not None and not args.json.parent.exists():
        raise UserError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    plugins = load_plugins()
    spec = plugins.require(args.backend)
    device = torch.device(spec.device())
    registry = plugins.registry(args.backend)
    ops = all_ops()
    unknown = set(args.op or []) - set(ops)
    if unknown:
        raise UserError(f"unknown op(s) {', '.join(sorted(unknown))}; ops: {', '.join(ops)}")
    golden = GoldenTensors()
    results = []
    for case in read_cases():
        if args.op and case.op not in args.op:
            continue
        kernel = registry.pick(ResolveContext(args.backend, device, case.torch_dtype), case.op, case.fmt)
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
        args.json.write_text(json.dumps({"backend": args.backend, "device": str(device), "torch": torch.__version__, "results": results}, indent=1))
    return 0
