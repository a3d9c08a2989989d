"""Fixtures of the model tests: the reference op table and tiny transformers-written checkpoints."""

from __future__ import annotations

import pytest
import torch

from deepinfer.runtime import open_runtime

from model.model_oracle import build_hf


@pytest.fixture(scope="session")
def ops():
    return open_runtime("reference", dtype=torch.float32).ops


@pytest.fixture(scope="session")
def v3_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_v3")
    return folder, build_hf("deepseek_v3", folder, seed=3)


@pytest.fixture(scope="session")
def v2_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_v2")
    return folder, build_hf("deepseek_v2", folder, seed=2)


