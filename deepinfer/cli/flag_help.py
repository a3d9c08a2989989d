"""`--help` a page at a time, for the commands with many flags (run, run-batch, serve), as vLLM's
`vllm serve --help=<group>` does: the flags sit in named argument groups, `--help` shows what the
command does and lists the groups, `--help=GROUP` one group (its flags and what they share),
`--help=all` every flag, and `--help=WORD` the flags whose name holds WORD (`--help=kv`). A whole
listing of such a command is over 200 lines; one group fits a terminal page.

A group's title is its name for --help (one word), and the first line of its description is the
summary the overview lists.
"""

from __future__ import annotations

import argparse
import sys

from deepinfer.errors import UserError

ALL = "all"


class GroupedHelp(argparse.Action):
    """-h / --help [GROUP | all | WORD]: print that help and exit 0; a name that matches nothing is a
    usage error (exit 2) listing the groups."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest="help", nargs="?", const="", default=argparse.SUPPRESS, metavar="GROUP",
                         help="this overview; GROUP: one group's flags, all: every flag, WORD: the flags whose name holds WORD")  # fmt: skip

    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message(help_text(parser, values or ""), sys.stdout)
        parser.exit()


def add_grouped_help(parser: argparse.ArgumentParser) -> None:
    """Give `parser` (made with add_help=False) the grouped -h / --help."""
    parser.add_argument("-h", "--help", action=GroupedHelp)


def flag_groups(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """The named groups that hold flags, by name, in the order the parser shows them."""
    return {g.title: g for g in parser._action_groups if g._group_actions and g.title not in ("options", "optional arguments", "positional arguments")}


def summary(group) -> str:
    return (group.description or "").strip().splitlines()[0] if group.description else ""


def help_text(parser: argparse.ArgumentParser, topic: str) -> str:
    """The text --help=`topic` prints ("" : the overview)."""
    groups = flag_groups(parser)
    wanted = topic.strip().lower()
    if wanted == "":
        return overview(parser, groups)
    if wanted == ALL:
        return parser.format_help()
    if wanted in groups:
        return sections(parser, [(groups[wanted], groups[wanted]._group_actions, True)])
    word = wanted.lstrip("-").replace("_", "-")
    found = [(g, [a for a in g._group_actions if any(word in s.lstrip("-") for s in a.option_strings)], False) for g in parser._action_groups]
    found = [(g, actions, full) for g, actions, full in found if actions and word]
    if not found:
        raise UserError(f"--help={topic}: no flag group or flag of `{parser.prog}` matches {topic!r}; "
                        f"the groups are {', '.join(groups)} (or all)")  # fmt: skip
    return sections(parser, found)


def sections(parser: argparse.ArgumentParser, parts) -> str:
    """The usage line, then each (group, flags, with its description) as argparse lays a group out."""
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    for group, actions, full in parts:
        formatter.start_section(group.title)
        if full:
            formatter.add_text(group.description)
        formatter.add_arguments(actions)
        formatter.end_section()
    return formatter.format_help()


def overview(parser: argparse.ArgumentParser, groups) -> str:
    """Usage, the command's description, the groups with their summaries, and how to see each."""
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    formatter.add_text(parser.description)
    text = formatter.format_help()
    width = max(len(name) for name in groups) + 2
    lines = ["", f"flag groups (`{parser.prog} --help=GROUP` shows one):"]
    lines += [f"  {name:<{width}}{summary(group)}" for name, group in groups.items()]
    lines += ["", f"`{parser.prog} --help=all` shows every flag, `--help=WORD` the flags whose name holds WORD (e.g. --help=kv)."]
    return text + "\n".join(lines) + "\n"
