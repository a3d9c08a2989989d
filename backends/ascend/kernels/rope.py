"""Ascend Triton kernels: rope (being written)."""

REGISTRATIONS = []
