"""`run`, `run-batch` and `serve` have about fifty flags each: `--help` is an overview that lists the
flag groups, `--help=GROUP` one group that fits a terminal page, `--help=all` every flag and
`--help=WORD` the flags whose name holds WORD (vLLM's `--help=<group>`)."""

from __future__ import annotations

import argparse

import pytest

from deepinfer.cli.flag_help import flag_groups
from deepinfer.cli.main import build_parser, main

COMMANDS = ("run", "run-batch", "serve")
PAGE_LINES = 50  # one terminal page
WIDTH = "100"


def subparser(name: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def help_of(capsys, monkeypatch, *argv: str) -> str:
    monkeypatch.setenv("COLUMNS", WIDTH)
    with pytest.raises(SystemExit) as stop:
        main(list(argv))
    assert stop.value.code == 0
    return capsys.readouterr().out


def visible_flags(parser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help" and a.help != argparse.SUPPRESS]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_sits_in_a_named_group(command):
    """A flag left outside the groups would show in no --help=GROUP page."""
    parser = subparser(command)
    grouped = {id(a) for group in flag_groups(parser).values() for a in group._group_actions}
    loose = [a.option_strings[-1] for a in visible_flags(parser) if id(a) not in grouped]
    assert not loose, f"{command}: flags outside every group: {loose}"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_an_overview_of_the_groups(command, capsys, monkeypatch):
    text = help_of(capsys, monkeypatch, command, "--help")
    assert len(text.splitlines()) <= PAGE_LINES, text
    for name in flag_groups(subparser(command)):
        assert f"\n  {name} " in text, f"{command} --help does not list the group {name}"
    assert "--max-num-seqs" not in text  # the flags themselves are one group away
    assert help_of(capsys, monkeypatch, command, "-h") == text


@pytest.mark.parametrize("command", COMMANDS)
def test_each_group_fits_a_page_and_shows_its_flags(command, capsys, monkeypatch):
    parser = subparser(command)
    for name, group in flag_groups(parser).items():
        for spelling in ([f"--help={name}"], ["--help", name]):
            text = help_of(capsys, monkeypatch, command, *spelling)
            assert len(text.splitlines()) <= PAGE_LINES, f"{command} --help={name} is {len(text.splitlines())} lines"
            for action in group._group_actions:
                assert action.option_strings[-1] in text, f"{command} --help={name} lacks {action.option_strings[-1]}"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_all_shows_every_flag(command, capsys, monkeypatch):
    text = help_of(capsys, monkeypatch, command, "--help=all")
    missing = [a.option_strings[-1] for a in visible_flags(subparser(command)) if a.option_strings[-1] not in text]
    assert not missing


def test_help_word_finds_the_flags_that_hold_it(capsys, monkeypatch):
    text = help_of(capsys, monkeypatch, "run", "--help=kv")
    assert "--num-kv-blocks" in text and "--kv-cache-dtype" in text
    assert "--max-num-seqs" not in text and "--temperature" not in text
    assert "--max-tokens" in help_of(capsys, monkeypatch, "run", "--help=--max-tokens")


def test_help_of_nothing_known_is_one_line_naming_the_groups(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", WIDTH)
    assert main(["run", "--help=nonsense"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "nonsense" in err and "sampling" in err and "structured" in err
