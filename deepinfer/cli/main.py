"""`deepinfer run | backends | conformance | bench`."""

from __future__ import annotations

import argparse
import logging
import sys

from deepinfer.errors import UserError

SUBCOMMANDS = ("run", "backends", "conformance", "bench")


class Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line and exit 2 (argparse prints the whole usage)."""

    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = Parser(prog="deepinfer", description="DeepSeek inference on any backend: cuda, ascend or the pure-torch reference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"deepinfer.cli.{name}")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:  # bare `deepinfer` runs the built-in prompts on the embedded default
            args = parser.parse_args([*argv, "run"])
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("deepinfer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
