"""Triton kernels: gemm (being written)."""

REGISTRATIONS = []
