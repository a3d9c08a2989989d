"""Ascend Triton kernels: moe (being written)."""

REGISTRATIONS = []
