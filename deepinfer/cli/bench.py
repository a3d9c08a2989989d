"""`deepinfer bench ops --backend NAME [--op OP] [--json FILE] [--plot FILE.png]`: benchmark a backend's ops.

Speed is measured here, never asserted in tests. A backend whose plugin module names a bench runner
(`BENCH_RUNNER = "package.module:function"`) gets its own benchmarks: the machine's ceilings, each op
at the shapes that matter and its torch peer, in one run (the cuda backend's does). Any other backend
is timed over the golden inputs of its conformance cases (warm-up, then the median of repeated runs,
synchronising the device around each), and the table gives the time per call.
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
    ops = what.add_parser("ops", help="benchmark the ops of a backend (its own runner, else the conformance shapes)")
    ops.add_argument("--backend", default="reference")
    ops.add_argument("--op", action="append", default=None, help="only this op (repeatable)")
    ops.add_argument("--repeat", type=int, default=10, help="timed runs per case (conformance-shape timing only)")
    ops.add_argument("--json", type=Path, default=None, help="write the results to FILE")
    ops.add_argument("--plot", type=Path, default=None, help="plot the fraction of the ceiling per case to FILE.png (backend runners only)")
    from deepinfer.cli import bench_ops_ep

    bench_ops_ep.add_arguments(ops)  # --ep N: dispatch/combine across N ranks (torchrun)
    ops.set_defaults(func=run_ops)
    e2e = what.add_parser("e2e", help="decode step time of a random DeepSeek-V2-Lite-shaped model vs its floor and HF transformers")
    e2e.add_argument("--backend", default="cuda")
    e2e.add_argument("--batch", type=int, action="append", default=None, help="batch size (repeatable; default 1 and 64)")
    e2e.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (default: all 27)")
    e2e.add_argument("--prompt-len", type=int, default=128)
    e2e.add_argument("--new-tokens", type=int, default=64)
    e2e.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    e2e.add_argument("--json", type=Path, default=None, help="write the results to FILE")
    e2e.set_defaults(func=run_e2e)
    from deepinfer.cli import bench_e2e_ep

    bench_e2e_ep.add_parser(what)  # `bench e2e-ep --ep N`: expert-parallel scaling
    comp = what.add_parser("compile", help="compile the cuda kernels ahead of time for SM90/SM100 (no GPU needed) and check registers, spills, MMA class")
    comp.add_argument("--arch", default="sm90,sm100", help="comma-separated: sm90, sm100 (default both)")
    comp.add_argument("--json", type=Path, default=None, help="write the results to FILE")
    comp.set_defaults(func=run_compile)
    p.set_defaults(func=lambda args: (_ for _ in ()).throw(UserError("say what to benchmark: `deepinfer bench ops --backend NAME` or `deepinfer bench e2e`")))


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def bench_runner(plugins, backend: str):
    """The backend's own bench runner, named by its plugin module's `BENCH_RUNNER` ("module:function"), or None."""
    import importlib

    spec = plugins.backend(backend)
    plugin = plugins.pm.get_plugin(spec.plugin) if spec.plugin else None
    target = getattr(plugin, "BENCH_RUNNER", None)
    if not target:
        return None
    module_name, _, func_name = str(target).partition(":")
    try:
        return getattr(importlib.import_module(module_name), func_name or "run")
    except Exception as exc:  # a broken runner is the backend's bug: say so in one line
        raise UserError(f"backend {backend!r}: its bench runner {target!r} failed to load: {type(exc).__name__}: {exc}")


def run_ops(args: argparse.Namespace) -> int:
    from deepinfer.plugins import load_plugins
    from deepinfer.registry import ResolveContext, all_ops
    from deepinfer_conformance.golden_io import GoldenTensors, read_cases
    from deepinfer_conformance.worker import to_device

    from deepinfer.cli import bench_ops_ep

    if bench_ops_ep.wants_ep(args):
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
    plugins = load_plugins()
    spec = plugins.require(args.backend)
    runner = bench_runner(plugins, args.backend)
    if runner is not None:
        runner(ops=args.op, json_path=args.json, plot_path=args.plot)
        return 0
    if args.plot is not None:
        raise UserError(f"--plot needs a backend bench runner; backend {args.backend!r} has none (only conformance-shape timing)")
    device = torch.device(spec.device())
    registry = plugins.registry(args.backend)
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


def run_e2e(args: argparse.Namespace) -> int:
    from deepinfer.bench import e2e

    batches = tuple(args.batch or (1, 64))
    for name, value in (("--batch", min(batches)), ("--prompt-len", args.prompt_len), ("--new-tokens", args.new_tokens), ("--layers", args.layers or 1)):
        if value < 1:
            raise UserError(f"{name} must be at least 1, not {value}")
    if args.json is not None and not args.json.parent.exists():
        raise UserError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    if not torch.cuda.is_available():
        raise UserError("`deepinfer bench e2e` measures on a GPU and needs one (the HF peer and the floor assume the cuda backend)")
    results = e2e.run(args.backend, batches, args.prompt_len, args.new_tokens, args.layers, with_hf=not args.no_hf, json_path=args.json)
    print(e2e.format_results(results))
    return 0


def run_compile(args: argparse.Namespace) -> int:
    """Exit 0 when every kernel compiled without spills at its expected MMA class (known failures
    aside), 1 otherwise; an unknown arch or an unwritable --json is a UserError (exit 2)."""
    import os

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from deepinfer_cuda.bench import compile_check

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    unknown = [a for a in archs if a not in compile_check.ARCHS]
    if not archs or unknown:
        raise UserError(f"unknown arch(s) {', '.join(unknown) or repr(args.arch)}; known: {', '.join(compile_check.ARCHS)}")
    if args.json is not None and not args.json.parent.exists():
        raise UserError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    print(compile_check.HEADER, flush=True)
    start = time.perf_counter()
    results = compile_check.run(archs, progress=lambda line: print(line, flush=True))
    ok = compile_check.passed(results)
    known = sum(1 for r in results if not r.ok and r.known_failure)
    print(f"{len(results)} kernels x arch in {time.perf_counter() - start:.0f} s: {'PASS' if ok else 'FAIL'} ({known} known failures)")
    if args.json is not None:
        args.json.write_text(compile_check.to_json(results))
    return 0 if ok else 1
