"""Fixtures of the model tests: the reference op table and tiny transformers-written checkpoints."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

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




@pytest.fixture
def ckpt(v3_checkpoint, tmp_path):
    """A writable copy of the tiny V3 checkpoint, in tmp_path/models/ckpt (a folder above it to escape to)."""
    source, _ = v3_checkpoint
    folder = tmp_path / "models" / "ckpt"
    shutil.copytree(source, folder)
    return folder


@pytest.fixture
def v3_copy(v3_checkpoint, tmp_path):
    """A writable copy of the tiny V3 checkpoint, and its tensors."""
    source, _ = v3_checkpoint
    folder = tmp_path / "ckpt"
    shutil.copytree(source, folder)
    return folder, load_file(str(folder / "model.safetensors"))
