"""The ascend backend's apply_penalties, apply_token_bias and gather_logprobs kernels under the Triton
interpreter (910B simulated; the 950's core counts and buffer in the second run): the tests of
tests/logits_kernel_checks.py."""

from __future__ import annotations

import pytest
import torch

from logits_kernel_checks import (  # noqa: F401  (pytest collects the imported tests)
    test_golden_cases_pass,
    test_logprobs_equal_the_reference,
    test_penalties_equal_the_reference,
    test_shapes_are_one_line_errors,
    test_token_bias_equals_the_reference,
)
from triton_mode import kernel_module, require_interpreter


@pytest.fixture(scope="module", params=["910B", "950"])
def device(request):
    """The CPU, with the chip whose core counts and buffer size the kernels' grids and tiles follow."""
    require_interpreter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_ASCEND_SIM_CHIP", request.param)
        yield torch.device("cpu")


@pytest.fixture(scope="module")
def processing(device):
    return kernel_module("deepinfer_ascend.kernels.logits_processing")


@pytest.fixture(scope="module")
def logprobs(device):
    return kernel_module("deepinfer_ascend.kernels.logprobs")
