"""deepinfer's Ascend backend (Atlas A2/A3 and Ascend 950: triton-ascend kernels plus torch_npu fused ops).

It lives in its own environment (extra `ascend`): triton-ascend installs the module `triton` and
cannot coexist with NVIDIA's Triton, and torch_npu needs CANN on the host. Registered through the
`deepinfer.backends` entry point like any third-party backend.
"""
