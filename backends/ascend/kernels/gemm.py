"""Ascend Triton kernels: gemm (being written)."""

REGISTRATIONS = []
