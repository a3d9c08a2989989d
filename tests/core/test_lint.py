"""`ruff check` of the whole tree is clean (pyproject.toml's [tool.ruff]: line length, import order,
unused and undefined names). CI runs the README's test command, so this test is how CI runs ruff;
ruff comes with the test extra."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_check_reports_nothing():
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]' (the test extra brings it)")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", str(ROOT)], capture_output=True, text=True, cwd=ROOT
    )
    if proc.returncode != 0:
        pytest.fail(f"ruff check {ROOT} reports (fix them; `ruff check --fix` fixes those marked [*]):\n{proc.stdout}{proc.stderr}", pytrace=False)
