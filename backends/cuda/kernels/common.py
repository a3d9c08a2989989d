"""What every cuda kernel module shares: the registration record, interpreter facts, launch helpers."""

from __future__ import annotations

import os

import torch

from deepinfer.registry import Registration  # noqa: F401  (kernel modules import it from here)


def interpreting() -> bool:
    """True when kernels run under TRITON_INTERPRET=1 (numpy on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# Deviation (interpreter only): Triton's interpreter returns garbage for tl.dot on bf16 operands
# (relative error ~1e10, seen with Triton 3.8/3.9 on 2026-11-30), while bf16 loaded and converted
# to float32 before the dot is exact. Kernels take `UPCAST_DOT: tl.constexpr` and convert their dot
# operands to float32 when it is set; on a GPU it is False and the tensor cores see bf16.
def upcast_dot() -> bool:
    return interpreting()


# float32 operands must not be truncated to tf32 (Triton's default on GPUs): the conformance
# tolerance for float32 is 1.3e-6 relative. Pass as `input_precision` to tl.dot.
def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def capability(device: torch.device | None = None) -> tuple[int, int]:
    """Compute capability of the tensors' device; (0, 0) on the CPU (interpreter)."""
    if device is None or device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)
