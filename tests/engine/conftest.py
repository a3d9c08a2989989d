"""Fixtures of the engine and `deepinfer run` tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """This module's model cache folder (the embedded models are written there on first use)."""
    return tmp_path_factory.mktemp("deepinfer_cache")


@pytest.fixture
def model_cache(cache, monkeypatch):
    """DEEPINFER_CACHE pointed at the module's `cache` (a module opts in: pytestmark = usefixtures)."""
    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))


@pytest.fixture(scope="module")
def api(cache):
    """An LLM over the embedded default on the reference backend, built once per test module (each
    module gives its own model `cache` folder)."""
    from deepinfer.engine.llm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        return LLM(backend="reference", announce=False, num_kv_blocks=64)


@pytest.fixture(scope="module")
def runtime():
    """The reference backend in float32."""
    from deepinfer.runtime import open_runtime

    return open_runtime("reference", dtype=torch.float32)


@pytest.fixture(scope="module")
def loaded(runtime, tmp_path_factory):
    """The embedded tiny DeepSeek-V3 default, loaded once per module on `runtime` (its own cache folder)."""
    from deepinfer.model.loader import load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(tmp_path_factory.mktemp("cache")))
        return load_model(None, runtime.ops, runtime.device, torch.float32)
