"""Structured output through the ascend backend's kernels (apply_token_bitmask and sampling among
them) in the Triton interpreter, a simulated 910B: the same tokens as the reference backend, valid outputs."""


def test_structured_requests_through_the_ascend_kernels(tmp_path, monkeypatch):
    from engine.structured_kernel_checks import check_structured_through

    monkeypatch.setenv("DEEPINFER_ASCEND_SIM_CHIP", "910B")
    check_structured_through("ascend", tmp_path)
