"""Structured output through the cuda backend's kernels (apply_token_bitmask and sampling among
them) in the Triton interpreter: the same tokens as the reference backend, valid outputs."""

from triton_mode import mode


def test_structured_requests_through_the_cuda_kernels(tmp_path):
    from engine.structured_kernel_checks import check_structured_through

    mode()  # fails loudly when the kernels can run neither interpreted nor compiled in this process
    check_structured_through("cuda", tmp_path)
