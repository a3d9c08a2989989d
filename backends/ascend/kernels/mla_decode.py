"""Ascend Triton kernels: mla_decode (being written)."""

REGISTRATIONS = []
