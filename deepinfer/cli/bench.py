"""`deepinfer bench WHAT`: benchmarks. Results go to the terminal and to --json files, never to test asserts.

Built in: `ops` times a backend's ops, `e2e` a decode step of a random DeepSeek-V2-Lite-shaped model
against its floor and HF transformers, `e2e-ep` expert-parallel decode over N devices,
`prefix-replay` DeepSeek-V4's prefix-cache hits (bounded replay) as the prefix grows, `prefix-reuse`
the KV tiers (host, disk, a restart on disk) on multi-turn conversations larger than the device pool, `swa-replay`
DeepSeek-V4.1's decoder SWA bounded replay on against off, `speculative`
speculative decoding's verification policies, `throughput` and `sweep` offline serving throughput
with per-request latencies (vLLM's `bench throughput` shape), `serve` an OpenAI-compatible server
over HTTP at a sweep of request rates (TTFT, TPOT, ITL), `plot` their PNG plots, `structured`
structured output's mask fill per step and constrained vs free throughput. Backend
plugins add their own subcommands through the `deepinfer_add_bench_commands` hook (the cuda backend
adds `compile`); `deepinfer bench --help` lists every one installed.
"""

from __future__ import annotations

import argparse
import sys

from deepinfer.errors import UserError


def add_parser(sub, argv: list[str] | None = None) -> None:
    """Add `bench` and its subcommands. The backend plugins' subcommands need the plugins loaded
    (which imports torch): that happens only when `argv` may name one (see wants_backend_commands);
    argv None means always."""
    from deepinfer.cli import (
        bench_e2e,
        bench_e2e_ep,
        bench_ops,
        bench_prefix_replay,
        bench_prefix_reuse,
        bench_serve,
        bench_speculative,
        bench_structured,
        bench_swa_replay,
        bench_throughput,
    )

    p = sub.add_parser("bench", help="benchmarks (results go to files, never to test asserts)", description=__doc__)
    what = p.add_subparsers(dest="what", metavar="WHAT", parser_class=type(p))
    bench_ops.add_parser(what)
    bench_e2e.add_parser(what)
    bench_e2e_ep.add_parser(what)  # `bench e2e-ep --ep N`: expert-parallel scaling
    bench_prefix_replay.add_parser(what)  # DeepSeek-V4: a prefix hit's bounded replay
    bench_prefix_reuse.add_parser(what)  # the KV tiers on multi-turn conversations larger than the device pool
    bench_swa_replay.add_parser(what)  # DeepSeek-V4.1: the decoder SWA bounded replay on vs off
    bench_speculative.add_parser(what)  # speculative decoding: fixed vs confidence-driven verification
    bench_throughput.add_parser(what)  # `throughput`, `sweep` (offline serving, vLLM's shape) and `plot`
    bench_serve.add_parser(what)  # `serve`: a server over HTTP at a sweep of request rates (vLLM's bench serve shape)
    bench_structured.add_parser(what)  # structured output: mask fill per step, constrained vs free throughput
    if argv is None or wants_backend_commands(argv, built_in=set(what.choices)):
        add_backend_commands(what)
    p.set_defaults(func=lambda args: say_what(what))


def wants_backend_commands(argv: list[str], built_in: set[str]) -> bool:
    """Whether the command line is `deepinfer bench` with no subcommand (bare, or --help: list them
    all) or with one that is not built in. Top-level options and `bench` itself take no values, so
    the first two words that are not options are the command and the subcommand."""
    words = [w for w in argv if not w.startswith("-")]
    if words[:1] != ["bench"]:
        return False
    return len(words) < 2 or words[1] not in built_in


def add_backend_commands(what) -> None:
    """Let every backend plugin add its subcommands; one that takes a built-in name is a plugin failure."""
    from deepinfer.plugins import load_plugins

    def add(name: str, **kwargs) -> argparse.ArgumentParser:
        if name in what.choices:
            raise ValueError(f"`deepinfer bench {name}` exists already")
        return what.add_parser(name, **kwargs)

    load_plugins().add_bench_commands(add)


def say_what(what) -> int:
    """A bare `deepinfer bench`: name every subcommand the parser has (built in and from plugins)."""
    names = ", ".join(what.choices)
    raise UserError(f"say what to benchmark: one of {names} (`deepinfer bench --help` says what each does)")


def choose_backend(plugins, name: str):
    """The BackendSpec to benchmark: `name`, or for "auto" the available one of highest priority, said on stderr."""
    if name != "auto":
        return plugins.require(name)
    spec, tried = plugins.auto()
    skipped = "; ".join(f"{n} unavailable: {a.reason}" for n, a in tried if not a.available)
    print(f"deepinfer: auto-selected {spec.name}" + (f" ({skipped})" if skipped else ""), file=sys.stderr)
    return spec


BACKEND_HELP = "auto (the default, as for `run`: cuda, then ascend, then reference) or a backend from `deepinfer backends`"


def add_backend_option_flag(parser: argparse.ArgumentParser, where: str) -> None:
    """`--backend-option KEY=VALUE` (repeatable), as `deepinfer run` takes it; `where` says what it reaches."""
    parser.add_argument("--backend-option", action="append", default=None, metavar="KEY=VALUE",
                        help=f"a backend option for {where}, e.g. ep_path=nccl (repeatable; `deepinfer backends` lists each backend's options)")


def backend_options(args: argparse.Namespace) -> dict[str, str]:
    """The --backend-option words as a dict, parsed as `deepinfer run` parses them (one line when malformed)."""
    from deepinfer.options import parse_assignments

    return parse_assignments(getattr(args, "backend_option", None))
