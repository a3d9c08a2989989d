"""Ascend Triton kernels: kv_cache (being written)."""

REGISTRATIONS = []
