"""Fixtures of the `deepinfer serve` tests: the embedded tiny model written once for all of them."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    from deepinfer.model.embedded import ensure_embedded

    root = tmp_path_factory.mktemp("deepinfer_cache")
    ensure_embedded(root)
    return root
