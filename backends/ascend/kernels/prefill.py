"""Ascend Triton kernels: prefill (being written)."""

REGISTRATIONS = []
