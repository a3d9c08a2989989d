"""Multi-rank conformance (deepinfer_conformance.multirank): when ranks write no report, one line
names the backend once, says each distinct error once and which ranks gave it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from deepinfer_conformance.multirank import ranks_failed_message

from waits import HANG_S


def test_an_error_that_names_the_backend_is_not_prefixed_again():
    failed = [(0, "backend 'cuda' is not available: no GPU; check nvidia-smi"), (1, "backend 'cuda' is not available: no GPU; check nvidia-smi")]
    assert ranks_failed_message("cuda", 2, failed) == "backend 'cuda' is not available: no GPU; check nvidia-smi (at ep 2: ranks 0, 1 wrote no report)"


def test_other_errors_get_the_backend_and_ep_once():
    assert ranks_failed_message("cuda", 4, [(1, "exit code -9"), (3, "exit code -9")]) == "backend 'cuda' at ep 4: ranks 1, 3 wrote no report (exit code -9)"
    mixed = ranks_failed_message("cuda", 2, [(0, "backend 'cuda' cannot serve op 'dispatch': no peers"), (1, "exit code 1")])
    assert mixed == "backend 'cuda' cannot serve op 'dispatch': no peers (at ep 2: rank 0 wrote no report); rank 1 wrote no report (exit code 1)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs the cuda backend to be unavailable (as on CI's CPU machines)")
def test_unavailable_backend_at_ep2_names_it_once():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-m", "deepinfer_conformance.multirank", "--backend", "cuda", "--ep", "2"],
                          capture_output=True, text=True, timeout=HANG_S, env=env)
    line = proc.stderr.strip()
    assert proc.returncode == 2 and "\n" not in line, proc.stderr
    assert line.startswith("deepinfer: error: backend 'cuda' is not available: ") and line.count("'cuda'") == 1, line
    assert line.endswith("(at ep 2: ranks 0, 1 wrote no report)"), line
