"""`deepinfer run | run-batch | serve | backends | conformance | bench`.

Building the parser imports no torch and loads no backend plugin (`deepinfer --help` answers at
once); each command imports what it needs when it runs. The one exception is `deepinfer bench`
asked for a subcommand that is not built in (or for its list): backend plugins add those.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from deepinfer import __version__
from deepinfer.errors import UserError

SUBCOMMANDS = ("run", "run-batch", "serve", "backends", "conformance", "bench")


class Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line and exit 2 (argparse prints the whole usage), and each
    parser records itself as the one whose --help a later "unrecognized arguments" points to."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.set_defaults(help_prog=self.prog)  # a subcommand's default overrides its parent's

    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `argv`, backend plugins are loaded only if it needs their commands."""
    parser = Parser(prog="deepinfer", description="DeepSeek inference on any backend: cuda, ascend or the pure-torch reference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"deepinfer.cli.{name.replace('-', '_')}")
        if name == "bench":
            module.add_parser(sub, argv)  # backend plugins may add bench subcommands
        else:
            module.add_parser(sub)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise UserError(f"unrecognized arguments: {' '.join(unknown)} (see `{args.help_prog} --help`)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Before the parser: loading backend plugins for `bench` may log a plugin failure.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        parser = build_parser(argv)
        args = parse(parser, argv)
        if args.command is None:  # bare `deepinfer` runs the built-in prompts on the embedded default
            args = parse(parser, [*argv, "run"])
        if args.verbose:
            logging.getLogger().setLevel(logging.DEBUG)
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("deepinfer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
