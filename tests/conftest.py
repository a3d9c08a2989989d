"""Shared fixtures: the out-of-tree backend plugin, installed for real into a temporary folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# CPU-only test machines: every Triton kernel runs in the interpreter. Triton decides at decoration
# time, so this must be set before anything imports triton (conftest is imported first).
os.environ.setdefault("TRITON_INTERPRET", "1")

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def oot_site(tmp_path_factory) -> Path:
    """pip-install tests/fixtures/oot_backend into a folder; return it (add it to PYTHONPATH)."""
    target = tmp_path_factory.mktemp("oot_site")
    build = tmp_path_factory.mktemp("oot_build")
    # Build from a copy: pip writes build/ and *.egg-info next to the sources.
    src = build / "oot_backend"
    subprocess.run(["cp", "-r", str(FIXTURES / "oot_backend"), str(src)], check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", "--target", str(target), str(src)],
        check=True,
    )
    return target


@pytest.fixture
def oot_env(oot_site) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(oot_site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env
