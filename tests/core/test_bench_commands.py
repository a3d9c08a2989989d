"""Backend plugins add `deepinfer bench` subcommands through a hook; the core bench CLI knows no backend.

(`deepinfer bench compile`, the cuda backend's, is run for real by tests/cuda/test_compile_check.py.)
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

import deepinfer.cli
import deepinfer.plugins as plugins_mod
from deepinfer.cli.main import main
from deepinfer.plugins import Plugins, hookimpl

from cli_helpers import run_cli


def _with_plugins(monkeypatch, *plugins) -> None:
    monkeypatch.setattr(plugins_mod, "load_plugins", lambda: Plugins(load_entry_points=False, extra_plugins=plugins))


def test_the_core_cli_imports_no_backend_package():
    for path in Path(deepinfer.cli.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("deepinfer_cuda", "deepinfer_ascend") for n in names), path.name


def test_a_plugin_adds_a_bench_subcommand(monkeypatch, capsys):
    seen = []

    def add_commands(add):
        p = add("hello", help="say hello")
        p.add_argument("--name", default="world")
        p.set_defaults(func=lambda args: seen.append(args.name) or 7)

    _with_plugins(monkeypatch, SimpleNamespace(deepinfer_add_bench_commands=hookimpl(add_commands)))
    assert main(["bench", "hello", "--name", "you"]) == 7
    assert seen == ["you"]
    assert main(["bench"]) == 2
    listed = "one of ops, e2e, e2e-ep, prefix-replay, prefix-reuse, swa-replay, speculative, throughput, sweep, plot, serve, structured, hello "
    assert listed in capsys.readouterr().err
    assert main(["bench", "hello", "--bogus"]) == 2
    assert "(see `deepinfer bench hello --help`)" in capsys.readouterr().err


def test_a_plugin_taking_a_built_in_name_or_failing_is_a_plugin_failure(monkeypatch, capsys):
    def takes_ops(add):
        add("ops", help="mine")

    def breaks(add):
        raise SystemExit(9)

    extra = (SimpleNamespace(deepinfer_add_bench_commands=hookimpl(takes_ops)), SimpleNamespace(deepinfer_add_bench_commands=hookimpl(breaks)))
    plugins = Plugins(load_entry_points=False, extra_plugins=extra)
    monkeypatch.setattr(plugins_mod, "load_plugins", lambda: plugins)
    assert main(["bench"]) == 2
    listed = "one of ops, e2e, e2e-ep, prefix-replay, prefix-reuse, swa-replay, speculative, throughput, sweep, plot, serve, structured "
    assert listed in capsys.readouterr().err
    errors = sorted(f.error for f in plugins.failures)
    assert errors == [
        "deepinfer_add_bench_commands raised SystemExit: 9",
        "deepinfer_add_bench_commands raised ValueError: `deepinfer bench ops` exists already",
    ]


def test_built_in_bench_commands_do_not_load_plugins(monkeypatch):
    def no_plugins():
        raise AssertionError("plugins loaded to parse a built-in bench command")

    monkeypatch.setattr(plugins_mod, "load_plugins", no_plugins)
    with pytest.raises(SystemExit):
        main(["bench", "e2e", "--help"])


def test_compile_comes_from_the_cuda_plugin():
    result = run_cli("bench", "compile", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: deepinfer bench compile" in result.stdout and "--arch" in result.stdout
