"""Shared by the ascend kernel modules: grid sizing by core count, interpreter facts, compile options.

triton-ascend maps each program of the grid to a physical core: vector kernels launch
`num_vectorcore` programs and tl.dot kernels `num_aicore`, and every program loops over its share of
the tiles (a persistent grid). Last dimensions are 32-byte aligned; blocks must fit the on-chip
buffer; index arithmetic stays in int32 (int64 is slow there). Ascend-only compile options are
passed only when triton-ascend is the installed Triton, so the same source runs under community
Triton's interpreter.
"""

from __future__ import annotations

import importlib.metadata

import torch

from deepinfer.registry import Registration  # noqa: F401  (kernel modules import it from here)
from deepinfer_ascend.device import current, interpreting  # noqa: F401


def is_triton_ascend() -> bool:
    try:
        importlib.metadata.version("triton-ascend")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def launch_options(**ascend_only) -> dict:
    """Extra kernel-launch keyword arguments (e.g. multibuffer=True) for triton-ascend only."""
    return dict(ascend_only) if is_triton_ascend() else {}


def vector_grid(num_tiles: int) -> int:
    """Programs for a vector kernel: one per vector core, never more than there are tiles."""
    return max(1, min(num_tiles, current().num_vectorcore))


def cube_grid(num_tiles: int) -> int:
    """Programs for a tl.dot kernel: one per AI core, never more than there are tiles."""
    return max(1, min(num_tiles, current().num_aicore))


def upcast_dot() -> bool:
    """Community Triton's interpreter computes bf16 tl.dot wrongly; operands go to float32 there."""
    return interpreting()


def aligned(n: int, dtype: torch.dtype) -> int:
    """n rounded up so a row of n elements is a multiple of 32 bytes."""
    per = max(1, 32 // torch.empty((), dtype=dtype).element_size())
    return -(-n // per) * per


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()
