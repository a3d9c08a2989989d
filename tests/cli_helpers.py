"""Running the `deepinfer` command in a subprocess, as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
