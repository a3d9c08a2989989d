"""The benchmark case record and the timing primitive. Not a bench module (no OPS): the runner leaves it out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class BenchCase:
    op: str
    name: str
    setup: Callable[[torch.device], dict]  # builds inputs on the device, once
    kernel: Callable[[dict], Any]  # one call of the deepinfer kernel
    peer: Callable[[dict], Any] | None  # one call of the torch equivalent (None: no peer)
    peer_name: str
    flops: Callable[[dict], float]  # minimal floating-point work of one call
    bytes: Callable[[dict], float]  # minimal device-memory traffic of one call (inputs read once, outputs written once)
    bound: str = "memory"  # "memory" (compare with copy bandwidth) or "compute" (compare with the matmul rate)
    graph: bool = False  # time from a CUDA graph of repeated calls (decode-sized calls: no launch overhead)


def time_ms(fn: Callable[[], Any], *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds per call, timed with CUDA events (triton.testing.do_bench)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
