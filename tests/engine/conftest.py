"""Fixtures of the engine and `deepinfer run` tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def api(cache):
    """An LLM over the embedded default on the reference backend, built once per test module (each
    module gives its own model `cache` folder)."""
    from deepinfer.engine.llm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        return LLM(backend="reference", announce=False, num_kv_blocks=64)
