"""What the cuda kernel modules share beyond `deepinfer.triton_common`: the registration record,
CUDA facts (compute capability, SM count, tf32 dots, warps per tile) and the split programs' arrival
counters. Not a registration module."""

from __future__ import annotations

from functools import cache, lru_cache

import torch

from deepinfer.registry import Registration  # noqa: F401  (kernel modules import it from here)
from deepinfer.triton_common import next_power_of_2


def dot_precision(dot_f32: bool) -> str:
    """`input_precision` of tl.dot: float32 operands must not be truncated to tf32 (Triton's default
    on GPUs): the conformance tolerance for float32 is 1.3e-6 relative."""
    return "ieee" if dot_f32 else "tf32"


def capability(device: torch.device | None = None) -> tuple[int, int]:
    """Compute capability of the tensors' device; (0, 0) on the CPU (interpreter)."""
    if device is None or device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


@cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device; 4 on the CPU (the interpreter: a few programs are
    plenty, and split choices stay exercised)."""
    if device.type != "cuda":
        return 4
    return _device_sms(device.index if device.index is not None else torch.cuda.current_device())


def num_warps_for(tile_elems: int, elem_bytes: int, cfg: dict) -> int:
    """Enough warps that each thread holds `bytes_per_thread` of the tile (whole 16-byte vectors),
    within the tuning entry's min_warps..max_warps."""
    warps = next_power_of_2(max((tile_elems * elem_bytes) // (32 * cfg["bytes_per_thread"]), 1))
    return max(cfg.get("min_warps", 1), min(cfg["max_warps"], warps))


ARRIVALS = 1 << 16  # arrival counters per device and user; a launch with more tiles than this merges by a second kernel


@lru_cache(maxsize=None)
def arrival_counters(device: torch.device, user: str) -> torch.Tensor:
    """Zeroed int32 counters in which a kernel's split programs count their arrivals, so that the last
    one to arrive merges the partials (no second launch). Each tile's merging program resets its
    counter to zero, so one allocation per (device, kernel family) serves every launch on the
    device's single compute stream, CUDA-graph replays included."""
    return torch.zeros(ARRIVALS, dtype=torch.int32, device=device)
