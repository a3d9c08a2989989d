"""The cuda backend's decode_plan kernel under the Triton interpreter (or compiled, with TRITON_INTERPRET=0 on a GPU):
the tests of tests/decode_plan_kernel_checks.py."""

from __future__ import annotations

import pytest
from decode_plan_kernel_checks import (  # noqa: F401  (pytest collects the imported tests)
    test_a_ring_that_splits_windows_is_a_one_line_error,
    test_golden_cases_pass,
    test_padding_only_empty_and_narrow_batches,
    test_random_decode_batches_equal_the_reference,
    test_v41_entry_tables_equal_the_reference,
)

from triton_mode import kernel_module, require_interpreter_or_gpu


@pytest.fixture(scope="module")
def device():
    return require_interpreter_or_gpu()


@pytest.fixture(scope="module")
def plan(device):
    return kernel_module("deepinfer_cuda.kernels.decode_plan")
