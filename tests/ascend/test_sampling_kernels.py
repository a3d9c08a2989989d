"""The ascend backend's sample, apply_token_bitmask and rejection_sample kernels under the Triton interpreter on
both simulated chips, and through Triton's front end. The checks are in
tests/ascend/vector_checks.py, which says why they run in a subprocess per chip."""

from __future__ import annotations

import pytest

from ascend.vector_checks import CHIPS, run_checks, run_frontend


@pytest.mark.parametrize("chip", CHIPS)
def test_sampling_kernels_under_the_interpreter(chip):
    run_checks("sampling", chip)


@pytest.mark.parametrize("chip", CHIPS)
def test_sampling_kernels_pass_the_triton_front_end(chip):
    run_frontend("sampling", chip)
