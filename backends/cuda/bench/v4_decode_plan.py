"""Benchmark of DeepSeek-V4's decode-step plan (decode_plan) at V4-Flash sizes, against the torch plan it replaced.

V4-Flash's decode step: window 128, CSA ratio 4 (its overlapping ring of 8 rows) and HCA ratio 128 (its plain ring
of 128), 8 output groups, KV blocks of 64 tokens, block tables as wide as a device graph's (`max_model_len`): 32k
and 1M tokens, so the entry tables are 8192 + 256 and 262,144 + 8192 entries a row. Batches of 1, 64 and 256
sequences at random positions of such a context, random pages, state slots 0 .. B - 1.
Bytes: the block tables read once, the other inputs, every output written (the entry tables are most of it: E_max
int32 per row and ratio). No floating point. Memory-bound at large tables; at small ones a launch is the figure:
the peer is the op's reference, the torch plan a decode step ran before the op (~50 launches, each 2-4 us),
graph-timed like the kernel (one launch), as a decode step's graph replays them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_cuda.bench.common import BenchCase

OPS = ("decode_plan",)  # what this bench module covers: the runner finds it by this
TABLE_ORDER = 85  # where its rows sit in `deepinfer bench ops`: after the V4 attention ops and hyper-connections

BLOCK_SIZE, WINDOW, GROUPS = 64, 128, 8
RATIOS, RINGS = (4, 128), ((4, True, 8), (128, False, 128))


@dataclass(frozen=True)
class GraphCase(BenchCase):
    """Decode-sized: timed from a CUDA graph replay (kernel and peer are graph-safe)."""

    graph: bool = True


def _setup(batch: int, context: int):
    def setup(device: torch.device) -> dict:
        g = torch.Generator(device=device).manual_seed(0)
        pages = context // BLOCK_SIZE
        positions = torch.randint(0, context, (batch,), device=device, generator=g)
        tables = torch.randint(0, batch * pages, (batch, pages), device=device, generator=g, dtype=torch.int32)
        slots = tables.long().gather(1, (positions // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE + positions % BLOCK_SIZE
        return {"inputs": (positions, tables, slots, torch.arange(batch, device=device, dtype=torch.int32))}

    return setup


_PARAMS = dict(block_size=BLOCK_SIZE, window=WINDOW, ratios=RATIOS, rings=RINGS, groups=GROUPS)


def _kernel(s: dict):
    from deepinfer_cuda.kernels.decode_plan import decode_plan

    return decode_plan(*s["inputs"], **_PARAMS)


def _peer(s: dict):
    from deepinfer.ops.decode_plan import decode_plan

    return decode_plan(*s["inputs"], **_PARAMS)


def _bytes(s: dict) -> float:
    positions, tables, _, _ = s["inputs"]
    batch, pages = tables.shape
    entries = sum(pages * BLOCK_SIZE // ratio for ratio in RATIOS)
    read = batch * (8 + 8 + 4) + tables.numel() * 4
    written = batch * (8 + 4 + 4 * WINDOW + 4 * entries + 4 * len(RATIOS) + 5 * 8 * len(RINGS)) + 4 * GROUPS
    return float(read + written)


def _flops(s: dict) -> float:
    return 0.0


PLAN = (_kernel, _peer, "torch reference (deepinfer.ops.decode_plan: the torch plan it replaced)", _flops, _bytes)

CASES = [GraphCase("decode_plan", f"decode_B{batch}_ctx{label}", _setup(batch, context), *PLAN)
         for batch, context, label in ((1, 1 << 15, "32k"), (64, 1 << 15, "32k"), (256, 1 << 15, "32k"), (1, 1 << 20, "1M"), (64, 1 << 20, "1M"))]  # fmt: skip
