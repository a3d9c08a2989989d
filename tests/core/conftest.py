"""Fixtures of the core tests."""

from __future__ import annotations

import pytest

from fake_backend import FakeBackend


@pytest.fixture
def fake(monkeypatch):
    """The fake backend (tests/fake_backend.py), and every `load_plugins()` (LLM, the CLI, and
    open_runtime's own reference to it) seeing it and the reference backend."""
    import deepinfer.plugins as plugins_mod
    import deepinfer.runtime as runtime_mod
    from deepinfer.plugins import Plugins

    backend = FakeBackend()
    monkeypatch.delenv("DEEPINFER_FAKE_NORM_FLAVOUR", raising=False)

    def load():
        from deepinfer.backends import reference

        return Plugins(load_entry_points=False, extra_plugins=(backend, reference))

    monkeypatch.setattr(plugins_mod, "load_plugins", load)
    monkeypatch.setattr(runtime_mod, "load_plugins", load)
    backend.plugins = load
    return backend
