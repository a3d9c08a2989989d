"""torch's CPU thread count is chosen, not inherited: on the CPU a run takes the usable cores but
one (an OpenMP team as wide as the machine stalls whenever another process is busy), unless
OMP_NUM_THREADS (torchrun ranks: 1) or --cpu-threads / LLM(cpu_threads=...) say otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from deepinfer.engine import cpu_threads
from deepinfer.engine.sampling_params import InvalidRequestError

from waits import HANG_S


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cpus, torch_default, want", [(1, 1, 1), (2, 2, 1), (8, 8, 7), (64, 32, 32), (16, 4, 4)])
def test_the_default_leaves_one_core(monkeypatch, cpus, torch_default, want):
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(torch, "get_num_threads", lambda: torch_default)
    assert cpu_threads.default_cpu_threads() == want


def test_the_rule_applies_on_the_cpu_unless_told(monkeypatch):
    monkeypatch.setattr(cpu_threads, "default_cpu_threads", lambda: 1)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    assert cpu_threads.use_cpu_threads(None, on_cpu=False) == 2  # an accelerator run: untouched
    assert cpu_threads.use_cpu_threads(None, on_cpu=True) == 1
    assert cpu_threads.use_cpu_threads(2, on_cpu=True) == 2  # explicit wins
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads.use_cpu_threads(None, on_cpu=True) == 2  # the environment's choice stands (torchrun ranks: 1)
    for bad in (0, -1, 1.5, True, 10**6):
        with pytest.raises(InvalidRequestError, match="cpu_threads"):
            cpu_threads.use_cpu_threads(bad, on_cpu=True)


def test_the_api_takes_cpu_threads(tmp_path, monkeypatch):
    from deepinfer.engine.llm import LLM

    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    torch.set_num_threads(2)
    LLM(backend="reference", announce=False, num_kv_blocks=8, cpu_threads=1)
    assert torch.get_num_threads() == 1
    with pytest.raises(InvalidRequestError, match="cpu_threads"):
        LLM(backend="reference", announce=False, num_kv_blocks=8, cpu_threads=0)


def test_the_cli_chooses_and_reports_the_thread_count(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["DEEPINFER_CACHE"] = str(tmp_path)
    probe = "import torch; from deepinfer.engine.cpu_threads import default_cpu_threads as d; print(d())"
    default = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout.strip()
    command = [sys.executable, "-m", "deepinfer", "run", "--backend", "reference", "--no-progress", "--prompt", "hi", "--max-tokens", "2"]
    for extra, want in (([], default), (["--cpu-threads", "2"], "2")):
        proc = subprocess.run([*command, *extra], env=env, capture_output=True, text=True, timeout=HANG_S)
        assert proc.returncode == 0, proc.stderr
        assert f"cpu threads       {want}\n" in proc.stderr, proc.stderr


def test_backends_shows_the_thread_count_run_uses(monkeypatch, capsys):
    """`deepinfer backends` showed torch's default (2 on a 2-core machine) where `run` uses the rule's 1 (issue 38)."""
    from deepinfer.cli.main import main

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: 4)
    torch.set_num_threads(4)  # torch's default on a 4-core machine; the rule: 3
    assert main(["backends"]) == 0
    reference = next(line for line in capsys.readouterr().out.splitlines() if "python" in line and "torch" in line)
    assert reference.rstrip().endswith("cpu threads 3"), reference
    assert cpu_threads.use_cpu_threads(None, on_cpu=True) == 3
