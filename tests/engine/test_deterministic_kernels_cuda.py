"""Deterministic mode end to end through the cuda backend's Triton kernels in the interpreter: the
checks of engine/deterministic_kernel_checks.py (which says what they check) with backend = "cuda"."""

from __future__ import annotations

import pytest

from engine.deterministic_kernel_checks import (  # noqa: F401 (the checks and their checkpoint fixture, collected here)
    checkpoint,
    test_chunked_prefill_and_a_prefix_hit_give_the_same_logits,
    test_logits_do_not_depend_on_the_batch,
    test_seeded_sampling_is_identical_over_200_completions,
    test_speculative_verification_gives_the_decode_steps_logits,
)


@pytest.fixture(scope="module")
def backend():
    return "cuda"
