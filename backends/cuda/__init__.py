"""deepinfer's CUDA backend (NVIDIA Hopper SM90 and Blackwell SM100, Triton kernels).

Registered through the `deepinfer.backends` entry point like any third-party backend. The probe
(`probe.py`) never starts the device; kernels are registered only once the backend is selected.
"""
