"""Fixtures of the DeepSeek-V4 tests: tiny random checkpoints written by transformers (model_v4/oracle.py)."""

from __future__ import annotations

import pytest

from model_v4.oracle import make_checkpoint


@pytest.fixture(scope="session")
def v4_checkpoint(tmp_path_factory):
    """v4_checkpoint(config="mixed", seed=0, names="hf") -> the checkpoint folder, written once per session and key.
    Treat it as read-only (copy it to change it)."""
    built = {}

    def get(config: str = "mixed", seed: int = 0, names: str = "hf"):
        key = (config, seed, names)
        if key not in built:
            built[key] = make_checkpoint(tmp_path_factory.mktemp(f"v4_{config}_{names}_s{seed}"), config, seed, names=names)
        return built[key]

    return get
