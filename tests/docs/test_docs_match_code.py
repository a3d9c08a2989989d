"""The docs a newcomer reads first must agree with the code: the README's commands parse, the counts
and lists the docs quote are the code's, and the example shows every kind of prompt readably."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.errors import UserError

from waits import HANG_S

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def readme_commands() -> list[str]:
    """The `deepinfer ...` lines of the README's "Use" block, without their comments."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("## Use", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.startswith("deepinfer ")]


@pytest.mark.parametrize("line", readme_commands())
def test_every_readme_command_parses(line):
    """A flag renamed or removed in the CLI must not leave the README behind."""
    from deepinfer.cli.main import build_parser

    words = shlex.split(re.split(r"\s#\s", line, maxsplit=1)[0])[1:]
    try:
        build_parser().parse_args(words)
    except UserError as exc:
        pytest.fail(f"README command {line!r} does not parse: {exc}")


@pytest.mark.parametrize("line", readme_commands())
def test_readme_says_which_commands_need_gpus(line):
    """A command that only runs on GPUs says so in its comment (a CPU user reads which to skip)."""
    command, comment = (re.split(r"\s#\s", line, maxsplit=1) + [""])[:2]
    cuda_run = "--backend cuda" in command and "conformance" not in command and "--interpret" not in command
    needs_gpu = (" e2e" in command and "e2e-ep" not in command) or "e2e-ep" in command or cuda_run
    if needs_gpu:
        assert "GPU" in comment, f"README command {command.strip()!r} needs a GPU but its comment does not say so"


def test_readme_describes_the_jsonl_input():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for key in ('"prompt"', '"messages"', '"prompt_token_ids"', '"custom_id"', '"error"'):
        assert key in text, f"README does not describe the JSONL key {key}"


def test_docs_name_capabilities_not_issue_numbers():
    """Issue numbers mean nothing to a reader of the docs; the capability's name does."""
    for path in DOCS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            assert not re.search(r"\bissue[ _-]?\d+", line, re.IGNORECASE), f"{path.name}:{number} refers to an issue number: {line.strip()}"


def test_architecture_lists_every_weight_format():
    from deepinfer.ops.gemm import FORMATS

    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [fmt for fmt in FORMATS if f'"{fmt}"' not in text]
    assert not missing, f"docs/architecture.md does not list the weight formats {missing}"


def test_support_matrix_quotes_the_golden_set_size():
    manifest = json.loads((ROOT / "conformance" / "golden" / "manifest.json").read_text())
    text = (ROOT / "docs" / "support-matrix.md").read_text(encoding="utf-8")
    quoted = re.search(r"the set now has (\d+)", text)
    assert quoted, "docs/support-matrix.md does not say how many golden cases the set has"
    assert int(quoted.group(1)) == len(manifest["cases"])


def test_distributed_doc_does_not_deny_ep_graphs():
    """The engine replays EP > 1 decode steps as CUDA graphs; the doc must not say they never are."""
    text = (ROOT / "docs" / "distributed.md").read_text(encoding="utf-8")
    assert "are not\n  captured in CUDA graphs" not in text and "are not captured in CUDA graphs" not in text


def test_example_prints_token_id_prompts_readably(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "offline_inference.py"), "--backend", "reference"],
        capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "prompt: None" not in result.stdout
    assert "prompt: token ids [" in result.stdout
