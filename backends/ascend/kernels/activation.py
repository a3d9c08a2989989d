"""Ascend Triton kernels: activation (being written)."""

REGISTRATIONS = []
