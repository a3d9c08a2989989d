"""Each ascend test starts with no simulated chip set by a runtime an earlier test opened in this
process (deepinfer_ascend.device.simulate): `current()` then follows DEEPINFER_ASCEND_SIM_CHIP, as
the tests that set it expect."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_simulated_chip_from_earlier_tests(monkeypatch):
    from deepinfer_ascend import device

    monkeypatch.setattr(device, "_simulated", None)
