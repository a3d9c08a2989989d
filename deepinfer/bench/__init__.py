"""Benchmarks that need no particular backend: end to end against HF transformers."""
