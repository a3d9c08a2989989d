"""The command line as a new user meets it: help without waiting for torch, --version, usage errors
that point to the right help, `bench` describing itself and listing every subcommand, and messages
that name a thing once."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys

import deepinfer
from deepinfer.cli.main import build_parser

from cli_helpers import run_cli
from waits import HANG_S

HELPS = [
    ["--help"],
    ["run", "--help"],
    ["backends", "--help"],
    ["conformance", "--help"],
    ["bench", "ops", "--help"],
    ["bench", "e2e", "--help"],
    ["bench", "e2e-ep", "--help"],
]

PROBE = """
import json, sys
from deepinfer.cli.main import main
seen = {}
for argv in json.loads(sys.argv[1]):
    try:
        main(argv)
    except SystemExit:
        pass
    seen[" ".join(argv)] = sorted(m for m in ("torch", "pluggy", "deepinfer.plugins", "deepinfer_cuda") if m in sys.modules)
print(json.dumps(seen), file=sys.stderr)
"""


def test_help_imports_no_torch_and_loads_no_plugin():
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(HELPS)], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stderr.strip().splitlines()[-1])
    assert seen == {" ".join(argv): [] for argv in HELPS}


# `bench` without a built-in subcommand loads every backend plugin to list (or parse) theirs.
PLUGIN_HELPS = [["bench", "--help"], ["bench"], ["bench", "compile", "--help"]]


def test_bench_help_loads_the_plugins_without_importing_torch():
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(PLUGIN_HELPS)], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stderr.strip().splitlines()[-1])
    assert seen == {" ".join(argv): ["deepinfer.plugins", "deepinfer_cuda", "pluggy"] for argv in PLUGIN_HELPS}


def _subcommands(parser, *path: str) -> dict:
    for name in path:
        action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = action.choices[name]
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return action.choices


def test_version_prints_the_package_version():
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"deepinfer {deepinfer.__version__}" == f"deepinfer {importlib.metadata.version('deepinfer')}"


def test_bench_help_describes_bench_itself():
    result = run_cli("bench", "--help")
    assert result.returncode == 0, result.stderr
    assert "deepinfer bench WHAT" in result.stdout and "golden inputs of its conformance cases" not in result.stdout
    for name in _subcommands(build_parser(), "bench"):
        assert re.search(rf"^    {re.escape(name)}\s", result.stdout, re.M), name  # a long name has its help on the next line


def test_bare_bench_lists_every_subcommand_from_the_parser():
    names = list(_subcommands(build_parser(), "bench"))
    assert {"ops", "e2e", "e2e-ep", "compile"} <= set(names)
    result = run_cli("bench")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert f"one of {', '.join(names)} " in lines[0]


def test_usage_errors_point_to_the_subcommand_help():
    cases = {
        ("run", "--bogus"): "unrecognized arguments: --bogus (see `deepinfer run --help`)",
        ("bench", "ops", "--bogus"): "unrecognized arguments: --bogus (see `deepinfer bench ops --help`)",
        ("bench", "ops", "--repeat", "x"): "(see `deepinfer bench ops --help`)",
        ("backends", "extra"): "unrecognized arguments: extra (see `deepinfer backends --help`)",
        ("--bogus",): "unrecognized arguments: --bogus (see `deepinfer --help`)",
    }
    for argv, expected in cases.items():
        result = run_cli(*argv)
        assert result.returncode == 2, argv
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("deepinfer: error: "), (argv, result.stderr)
        assert expected in result.stderr, (argv, result.stderr)


def test_bench_backend_options_explain_themselves_and_share_the_default():
    for command in ("ops", "e2e"):
        option = next(a for a in _subcommands(build_parser(), "bench")[command]._actions if "--backend" in a.option_strings)
        assert option.default == "auto", command
        assert "auto" in option.help and "cuda, then ascend, then reference" in option.help, command


def test_bench_ops_without_backend_takes_auto_and_says_which(tmp_path):
    out = tmp_path / "ops.json"
    result = run_cli("bench", "ops", "--op", "rms_norm", "--repeat", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "deepinfer: auto-selected reference (cuda unavailable" in result.stderr
    assert json.loads(out.read_text())["backend"] == "reference"


def test_an_unavailable_backend_is_named_once():
    result = run_cli("conformance", "--backend", "cuda", "--op", "rms_norm")
    assert result.returncode == 2
    line = result.stderr.strip()
    assert "\n" not in line and line.count("'cuda'") == 1 and "is not available" in line


def test_the_run_summary_names_the_backend_once():
    result = run_cli("run", "--backend", "reference", "--prompt", "hi", "--max-tokens", "1", "--no-progress")
    assert result.returncode == 0, result.stderr
    backend_line = next(line for line in result.stderr.splitlines() if line.strip().startswith("backend "))
    assert backend_line.split() == ["backend", "reference", "(requested)"]
