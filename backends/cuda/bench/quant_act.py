"""Benchmarks of the fp8 activation quantiser that runs before every fp8_block `linear` / `grouped_gemm`.

`deepinfer_cuda.kernels.gemm.quantize_act_fp8`: bf16 rows [M, K] -> e4m3 values [M, K] and one float32
scale per row and 128-column group. V4-Flash's hidden width K = 4096 at M = 1 and 64 rows (decode
batches: a step quantises ~10 activations a layer this way). Bytes: x read, the e4m3 values and the
scales written; flops: 3 per element (the group maximum, two divisions) — memory-bound in principle,
latency-bound at these sizes (64 KB or less moved). Graph-timed: the kernel takes a few microseconds.
The peer is the reference quantiser (deepinfer.ops.quant, torch), bit-identical by contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_cuda.bench.common import BenchCase

OPS = ("linear",)  # what this bench module covers: the runner finds it by this (the fp8 path of linear)
TABLE_ORDER = 31  # where its rows sit in `deepinfer bench ops`: beside the GEMMs

HIDDEN = 4096


@dataclass(frozen=True)
class GraphCase(BenchCase):
    """Decode-sized: timed from a CUDA graph replay (the quantiser and its peer are graph-safe)."""

    graph: bool = True


def _setup(rows: int, k: int):
    def setup(device: torch.device) -> dict:
        g = torch.Generator(device=device).manual_seed(0)
        return {"x": torch.randn(rows, k, device=device, dtype=torch.bfloat16, generator=g)}

    return setup


def _kernel(s: dict):
    from deepinfer_cuda.kernels.gemm import quantize_act_fp8

    return quantize_act_fp8(s["x"])


def _peer(s: dict):
    from deepinfer.ops.quant import quantize_act_fp8

    return quantize_act_fp8(s["x"])


def _bytes(s: dict) -> float:
    x = s["x"]
    return x.numel() * (x.element_size() + 1) + x.shape[0] * -(-x.shape[1] // 128) * 4


def _flops(s: dict) -> float:
    return 3.0 * s["x"].numel()


CASES = [
    GraphCase("linear", f"fp8 activation quantiser M{m} K{HIDDEN} bf16 (decode)", _setup(m, HIDDEN), _kernel, _peer,
              "torch reference (deepinfer.ops.quant.quantize_act_fp8)", _flops, _bytes)
    for m in (1, 64)
]
