"""The ascend backend's decode_plan kernel under the Triton interpreter (910B simulated; the 950's core counts and
buffer in the second run): the tests of tests/decode_plan_kernel_checks.py, and the kernel's launches through Triton's
real front end (tests/ascend/vector_checks.py's decode_plan family)."""

from __future__ import annotations

import pytest
import torch
from decode_plan_kernel_checks import (  # noqa: F401  (pytest collects the imported tests)
    test_a_ring_that_splits_windows_is_a_one_line_error,
    test_golden_cases_pass,
    test_padding_only_empty_and_narrow_batches,
    test_random_decode_batches_equal_the_reference,
    test_v41_entry_tables_equal_the_reference,
)

from ascend.vector_checks import CHIPS, run_frontend
from triton_mode import kernel_module, require_interpreter


@pytest.fixture(scope="module", params=CHIPS)
def device(request):
    """The CPU, with the chip whose core counts and buffer size the kernel's grid and tiles follow."""
    require_interpreter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_ASCEND_SIM_CHIP", request.param)
        yield torch.device("cpu")


@pytest.fixture(scope="module")
def plan(device):
    return kernel_module("deepinfer_ascend.kernels.decode_plan")


@pytest.mark.parametrize("chip", CHIPS)
def test_decode_plan_kernel_passes_the_triton_front_end(chip):
    run_frontend("decode_plan", chip)
