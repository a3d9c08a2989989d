"""Deterministic mode end to end through the ascend backend's Triton kernels in the interpreter: the
checks of engine/deterministic_kernel_checks.py (which says what they check) with backend = "ascend",
but the 200 seeded completions: the cuda file runs those through the engine (50 s of CI in the
interpreter), and the ascend sampling kernel's batch invariance is checked directly
(tests/ascend/test_batch_invariance.py)."""

from __future__ import annotations

import pytest

from engine.deterministic_kernel_checks import (  # noqa: F401 (the checks and their checkpoint fixture, collected here)
    checkpoint,
    test_chunked_prefill_and_a_prefix_hit_give_the_same_logits,
    test_logits_do_not_depend_on_the_batch,
)


@pytest.fixture(scope="module")
def backend():
    return "ascend"
