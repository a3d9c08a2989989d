"""Running the `deepinfer` command in a subprocess, as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def write_lines(path: Path, items) -> Path:
    """A JSONL file of `items`: dicts are dumped, strings written as they are (broken lines on purpose)."""
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items), encoding="utf-8")
    return path
