"""The cuda backend's apply_penalties, apply_token_bias and gather_logprobs kernels under the Triton
interpreter (or compiled, with TRITON_INTERPRET=0 on a GPU): the tests of tests/logits_kernel_checks.py."""

from __future__ import annotations

import pytest

from logits_kernel_checks import (  # noqa: F401  (pytest collects the imported tests)
    test_golden_cases_pass,
    test_logprobs_equal_the_reference,
    test_penalties_equal_the_reference,
    test_shapes_are_one_line_errors,
    test_token_bias_equals_the_reference,
)
from triton_mode import kernel_module, require_interpreter_or_gpu


@pytest.fixture(scope="module")
def device():
    return require_interpreter_or_gpu()


@pytest.fixture(scope="module")
def processing(device):
    return kernel_module("deepinfer_cuda.kernels.logits_processing")


@pytest.fixture(scope="module")
def logprobs(device):
    return kernel_module("deepinfer_cuda.kernels.logprobs")
