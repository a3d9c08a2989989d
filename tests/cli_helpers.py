"""Running the `deepinfer` command in a subprocess, as a user would, or its `main` in this process
(for the many one-line usage errors: the same parser and error path, without a new interpreter and
torch import for each)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

from waits import HANG_S


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def run_main(*args: str) -> subprocess.CompletedProcess:
    """`deepinfer ARGS` through deepinfer.cli.main.main in this process: its exit code (argparse's
    SystemExit included) and what it printed."""
    from deepinfer.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["deepinfer", *args], code, out.getvalue(), err.getvalue())


def write_lines(path: Path, items) -> Path:
    """A JSONL file of `items`: dicts are dumped, strings written as they are (broken lines on purpose)."""
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items), encoding="utf-8")
    return path
