"""`deepinfer conformance --backend X [--backend Y] [--interpret] [--op OP] [--backend-option KEY=VALUE] [--json FILE]`."""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("conformance", help="compare backends against the golden set and each other", description=__doc__)
    p.add_argument("--backend", action="append", required=True, help="backend to check; repeat to compare several (the first is the baseline)")
    p.add_argument("--interpret", action="store_true", help="run Triton kernels under TRITON_INTERPRET=1 on the CPU")
    p.add_argument("--op", action="append", default=None, help="only this op (repeatable)")
    p.add_argument("--backend-option", action="append", metavar="KEY=VALUE",
                   help="a backend option for the backends that declare it, e.g. npu_fast_paths=on (repeatable; see `deepinfer backends`)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON to FILE")
    p.add_argument("--golden", type=Path, default=None, help="golden set folder (default: the packaged one)")
    p.add_argument("--deterministic", action="store_true",
                   help="check the kernels deterministic mode chooses (the batch-invariant ones); an op without one is a missing row")
    p.add_argument("--quiet", action="store_true", help="print failing rows and the summary only (which names the ops without a kernel)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from deepinfer_conformance import runner
    from deepinfer_conformance.golden_io import GOLDEN_DIR

    if len(set(args.backend)) != len(args.backend):
        raise UserError("each --backend may be given once")
    golden = args.golden or GOLDEN_DIR
    if not (Path(golden) / "manifest.json").is_file():
        raise UserError(f"no golden set at {golden} (manifest.json missing); run `python -m deepinfer_conformance.generate`")
    if args.json is not None and not args.json.parent.exists():
        raise UserError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    from deepinfer.options import parse_assignments

    rows = runner.run(args.backend, interpret=args.interpret, ops=args.op, golden_dir=Path(golden), options=parse_assignments(args.backend_option),
                      deterministic=args.deterministic)  # fmt: skip
    shown = [r for r in rows if r.status not in ("pass", runner.NO_KERNEL) or r.cross_ok is False] if args.quiet else rows
    if shown:
        print(runner.format_table(shown))
    text, ok = runner.summary(rows)
    mode = (" (Triton interpreter)" if args.interpret else "") + (" (deterministic: batch-invariant kernels)" if args.deterministic else "")
    print(f"\nconformance {' vs '.join(args.backend)}{mode}: {text}")
    if args.json is not None:
        runner.write_json(rows, args.json)
    return 0 if ok else 1
