"""Ascend Triton kernels: norm (being written)."""

REGISTRATIONS = []
