"""The commands docs/performance.md and tools/gpu/README.md give for their figures must parse: a flag
renamed or removed in the CLI must not leave behind the page that says how a figure was measured."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from deepinfer.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "docs" / "performance.md", ROOT / "tools" / "gpu" / "README.md"]


def page_commands() -> list:
    """Every `deepinfer ...` command in backticks (wrapped lines joined) and every code-block line that
    starts with one (its comment dropped); a command with an ellipsis is prose, not a command."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        inline = [" ".join(m.group(1).split()) for m in re.finditer(r"`(deepinfer [^`]+)`", text)]
        blocks = [re.split(r"\s#\s", line, maxsplit=1)[0].strip() for line in text.splitlines() if line.startswith("deepinfer ")]
        found += [pytest.param(command, id=f"{page.name}: {command[:60]}") for command in inline + blocks if "..." not in command]
    return found


def test_the_pages_give_their_commands():
    assert len(page_commands()) >= 15


@pytest.mark.parametrize("command", page_commands())
def test_every_measurement_command_parses(command):
    from deepinfer.cli.main import build_parser

    words = shlex.split(command)[1:]
    try:
        build_parser(words).parse_args(words)
    except (UserError, SystemExit) as exc:
        pytest.fail(f"{command!r} does not parse: {exc}")
