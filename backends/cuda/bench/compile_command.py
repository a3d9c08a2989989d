"""`deepinfer bench compile --arch sm90,sm100 [--case TEXT] [--sweep VARIANT] [--json FILE]`: the cuda backend's own bench subcommand.

The cuda plugin adds it to `deepinfer bench` through the `deepinfer_add_bench_commands` hook, so the
core CLI knows nothing of CUDA architectures. It compiles every cuda kernel ahead of time for SM90 and
SM100 on any machine (no GPU needed) and checks registers, spills and the matrix instruction class
(deepinfer_cuda.bench.compile_check says how). Not a bench module (no OPS).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from deepinfer.errors import UserError


def add_compile_command(add) -> None:
    p = add(
        "compile",
        help="cuda backend: compile its kernels ahead of time for SM90/SM100 (no GPU needed); check registers, spills, MMA class",
        description=__doc__,
    )
    p.add_argument("--arch", default="sm90,sm100", help="comma-separated: sm90, sm100 (default both)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results to FILE")
    p.add_argument("--case", default=None, metavar="TEXT", help="only the cases whose name contains TEXT (e.g. gluon: the Gluon kernels, which CI compiles)")
    p.add_argument("--sweep", default=None, metavar="VARIANT",
                   help="instead of the cases: a sweep's candidates at its shapes, before a GPU times them (the gemm sweep's fp8_v4_prefill, "
                        "fp8_gluon_large; attention_prefill's prefill_gluon; sparse_attention_sweep's sparse_gluon_bf16)")
    p.set_defaults(func=run_compile)


def run_compile(args: argparse.Namespace) -> int:
    """Exit 0 when every kernel compiled without spills at its expected MMA class (known failures
    aside), 1 otherwise; an unknown arch or an unwritable --json is a UserError (exit 2)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # read when triton is imported (next line)
    from deepinfer_cuda.bench import compile_check

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    unknown = [a for a in archs if a not in compile_check.ARCHS]
    if not archs or unknown:
        raise UserError(f"unknown arch(s) {', '.join(unknown) or repr(args.arch)}; known: {', '.join(compile_check.ARCHS)}")
    if args.json is not None and not args.json.parent.exists():
        raise UserError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    try:
        pool = compile_check.CASES if args.sweep is None else compile_check.sweep_cases(args.sweep)
    except ValueError as exc:
        raise UserError(f"--sweep: {exc}") from exc
    cases = [c for c in pool if args.case is None or args.case in c.name]
    if not cases:
        raise UserError(f"no compile case's name contains {args.case!r}; `deepinfer bench compile --arch sm90` lists them all")
    print(compile_check.HEADER, flush=True)
    start = time.perf_counter()
    results = compile_check.run(archs, cases=cases, progress=lambda line: print(line, flush=True))
    ok = compile_check.passed(results)
    known = sum(1 for r in results if not r.ok and r.known_failure)
    print(f"{len(results)} kernels x arch in {time.perf_counter() - start:.0f} s: {'PASS' if ok else 'FAIL'} ({known} known failures)")
    if args.json is not None:
        args.json.write_text(compile_check.to_json(results))
    return 0 if ok else 1
