"""Ascend Triton kernels: sampling (being written)."""

REGISTRATIONS = []
