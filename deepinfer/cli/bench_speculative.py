"""`deepinfer bench speculative`: speculative decoding's verification policies (fixed k against
confidence-driven: calibrated online, or read off a confidence head as DSpark's `head` policy does)
on a random DeepSeek-V2-Lite-shaped model at given numbers of concurrent requests: tokens/s against
the run without speculation, acceptance length, drafts verified per step, the share of verified
drafts accepted. The drafts come from a draft source that agrees with each request's recorded
continuation at a geometric rate (random weights accept no MTP draft; deepinfer/bench/speculative.py
says how). Every run is in deterministic mode unless --no-deterministic:
otherwise outputs leave their recorded continuations at near-ties and acceptance counts nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deepinfer.errors import UserError


def add_parser(what) -> None:
    from deepinfer.cli.bench import BACKEND_HELP

    p = what.add_parser("speculative", help="speculative decoding: fixed k vs confidence-driven verification (controlled drafts)",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--backend", default="auto", help=BACKEND_HELP)
    p.add_argument("--concurrency", type=int, action="append", default=None, help="concurrent requests (repeatable; default 16 and 64)")
    p.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (default: all 27)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    p.add_argument("--num-drafts", type=int, default=5, help="drafts per request and step, k (default 5)")
    p.add_argument("--first", type=float, default=0.9, help="probability that draft 1 agrees (default 0.9)")
    p.add_argument("--decay", type=float, default=0.8, help="each further draft agrees with this factor less (default 0.8)")
    p.add_argument("--spread", type=float, default=0.5, help="per-request factor on the profile, uniform in [1 - spread, 1] (default 0.5)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="every run in deterministic mode (the default): continuations do not depend on batch shapes, so the controlled drafts keep "
                        "agreeing; --no-deterministic: the backend's fastest kernels, whose near-ties send outputs off their recorded continuations "
                        "(those rows are flagged: their acceptance under-counts)")
    p.add_argument("--policies", default="fixed,confidence", metavar="LIST",
                   help="the policies measured, comma-separated, of fixed, confidence, head (DSpark's confidence-head policy); default fixed,confidence")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results to FILE")
    p.set_defaults(func=run_speculative)


def run_speculative(args: argparse.Namespace) -> int:
    from deepinfer.bench import speculative
    from deepinfer.bench.e2e import V2_LITE
    from deepinfer.cli.bench import choose_backend
    from deepinfer.engine.speculative.config import MAX_DRAFTS, POLICIES
    from deepinfer.plugins import load_plugins

    concurrency = tuple(args.concurrency or (16, 64))
    counts = (("--concurrency", min(concurrency)), ("--prompt-len", args.prompt_len), ("--new-tokens", args.new_tokens), ("--layers", args.layers or 1))
    for name, value in counts:
        if value < 1:
            raise UserError(f"{name} must be at least 1, not {value}")
    if not 1 <= args.num_drafts <= MAX_DRAFTS:
        raise UserError(f"--num-drafts must lie in [1, {MAX_DRAFTS}], not {args.num_drafts}")
    if args.layers is not None and args.layers > V2_LITE["num_hidden_layers"]:
        raise UserError(f"--layers cuts the model: at most {V2_LITE['num_hidden_layers']}, not {args.layers}")
    for name, value in (("--first", args.first), ("--decay", args.decay)):
        if not 0 < value <= 1:
            raise UserError(f"{name} must lie in (0, 1], not {value}")
    if not 0 <= args.spread < 1:
        raise UserError(f"--spread must lie in [0, 1), not {args.spread}")
    if args.prompt_len + args.new_tokens + args.num_drafts + 1 > V2_LITE["max_position_embeddings"]:
        raise UserError(f"--prompt-len + --new-tokens exceeds the model's {V2_LITE['max_position_embeddings']} positions")
    policies = tuple(args.policies.split(","))
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies or len(set(policies)) != len(policies):
        raise UserError(f"--policies lists distinct policies of {', '.join(POLICIES)}, not {args.policies!r}")
    if args.json is not None and not args.json.parent.exists():
        raise UserError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    spec = choose_backend(load_plugins(), args.backend)
    results = speculative.run(spec.name, concurrency, layers=args.layers, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                              num_drafts=args.num_drafts, first=args.first, decay=args.decay, spread=args.spread, json_path=args.json,
                              on_result=lambda r: print(f"measured: {r}", flush=True), deterministic=args.deterministic, policies=policies)  # fmt: skip
    print(speculative.format_results(results))
    notes = speculative.notes(results, args.deterministic)
    for line in notes:
        print(line, file=sys.stderr)
    return 1 if notes and args.deterministic else 0
