"""`deepinfer backends` prints every kernel note whole, within the terminal's width, and every
backend's options."""

from __future__ import annotations

import json
import os

from deepinfer.cli.backends import format_report

from cli_helpers import run_cli

LONG_NOTE = (
    "Triton: one tiled GEMM (grouped tiles, split-K for decode shapes) for dense, fp8_block (fused per-token-group "
    "quantiser, fp8 tl.dot per 128-K group, DeepGEMM-style promotion) and mxfp4"
)


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_long_notes_wrap_instead_of_being_cut():
    report = {
        "backends": [
            {"name": "gpu", "available": False, "reason": "no device", "hint": "buy one",
             "coverage": {"linear": [LONG_NOTE, "a second kernel"]}, "coverage_source": "interpreter"},
            {"name": "cpu", "available": True, "reason": "here", "hint": "", "coverage": {"linear": ["pure torch"]}, "coverage_source": "device"},
        ],
        "plugin_failures": [],
    }
    text = format_report(report, ["linear", "rope"], width=80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert LONG_NOTE in _flat(text) and "a second kernel" in text
    assert "gpu: 1/2 ops covered, 0 with a batch-invariant kernel (as registered for the Triton interpreter: no device here)" in _flat(text)
    assert "cpu: 1/2 ops covered, 0 with a batch-invariant kernel\n" in text
    assert "rope                 - (no kernel)" not in text and "rope    - (no kernel)" in text


def test_the_cli_shows_every_note_of_every_backend_within_the_width():
    env = {**os.environ, "COLUMNS": "80"}
    listing = run_cli("backends", env=env)
    report = run_cli("backends", "--json", env=env)
    assert listing.returncode == 0 and report.returncode == 0, listing.stderr + report.stderr
    text = _flat(listing.stdout)
    for backend in json.loads(report.stdout)["backends"]:
        for op, notes in backend["coverage"].items():
            for note in notes:
                assert _flat(note) in text, (backend["name"], op, note)
    assert max(len(line) for line in listing.stdout.splitlines()) <= 80
    assert "(registered (" not in listing.stdout


EP_PATH = {"name": "ep_path", "choices": ["auto", "nccl"], "default": "auto", "env": "DEEPINFER_EP_PATH", "help": "which dispatch/combine path the ranks take"}
SIM = {"name": "sim", "choices": ["a", "b"], "default": "b", "env": None, "help": "the simulated chip"}


def test_each_backends_options_are_listed_with_values_default_env_and_help():
    report = {
        "backends": [
            {"name": "gpu", "available": False, "reason": "no device", "hint": "", "coverage": {}, "options": [EP_PATH, SIM]},
            {"name": "cpu", "available": True, "reason": "here", "hint": "",
             "coverage": {"linear": ["pure torch"]}, "coverage_source": "device", "options": []},
        ],
        "plugin_failures": [],
    }
    lines = format_report(report, ["linear"], width=100).splitlines()
    start = lines.index("options of gpu (--backend-option KEY=VALUE, or LLM(backend_options={...})):")
    assert lines[start + 1:start + 5] == [
        "  ep_path: auto | nccl (default: auto, or $DEEPINFER_EP_PATH when set)",
        "      which dispatch/combine path the ranks take",
        "  sim: a | b (default: b)",
        "      the simulated chip",
    ]
    assert "options of cpu: none" in lines
    firsts = [line.split()[0] for line in lines if line.strip()]
    assert firsts.count("gpu") == firsts.count("cpu") == 1  # a backend's bare name starts only its availability line


def test_the_cli_lists_every_option_of_every_backend():
    env = {**os.environ, "COLUMNS": "80"}
    listing = run_cli("backends", env=env)
    report = run_cli("backends", "--json", env=env)
    assert listing.returncode == 0 and report.returncode == 0, listing.stderr + report.stderr
    text = _flat(listing.stdout)
    backends = json.loads(report.stdout)["backends"]
    assert any(b["options"] for b in backends)
    for backend in backends:
        for option in backend["options"]:
            env_part = f", or ${option['env']} when set" if option["env"] else ""
            assert f"{option['name']}: {' | '.join(option['choices'])} (default: {option['default']}{env_part})" in text, option
            assert _flat(option["help"]) in text, option
