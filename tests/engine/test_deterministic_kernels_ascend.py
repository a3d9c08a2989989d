"""Deterministic mode end to end through the ascend backend's Triton kernels in the interpreter: the
checks of engine/deterministic_kernel_checks.py (which says what they check) with backend = "ascend",
but the 200 seeded completions (they run through the cuda kernels compiled on a GPU; in CI the
reference backend's 200 completions and the ascend sampling kernel's batch invariance,
tests/ascend/test_batch_invariance.py, cover them)."""

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
