"""Ascend Triton kernel: cache_round (DeepSeek-V4.1's fp8 / nvfp4 / mxfp4 cache formats as a quantize-dequantize rounding).

The tensor is viewed as rows of C channels and each row as groups of GROUP consecutive channels (the
last one padded with zeros). A persistent vector grid (`vector_grid`): each program loops over tiles
of BLOCK_G groups, one group a row of the tile, rounded by
`deepinfer.triton_cache_rounding.round_groups` (bit-exact with the reference: float32 arithmetic,
correctly rounded divisions, scales on the float32 bits, e4m3 by integer rounding since A2/A3 have no
float8 type, e2m1 by comparisons) and stored rounded to nearest even (`to_output`).

Buffer: a tile is BLOCK_G x GROUP float32 values plus about six temporaries of the same shape (the
quotients, the rounding's int32 bits, the levels): 28 bytes per element, 128 groups of 32 -> 112 KB
at most; `tile_elems` keeps it within half the unified buffer. Index arithmetic is int32; IDX64
switches to int64 offsets for tensors of 2^31 elements or more; float64 (a test dtype) goes to the
reference. Batch-invariant as it is: each group alone, its amax a max.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.cache_rounding import CACHE_FORMATS, GROUP
from deepinfer.ops.cache_rounding import cache_round as _reference
from deepinfer.triton_cache_rounding import round_groups
from deepinfer.triton_common import cdiv
from deepinfer_ascend.kernels.common import Registration, launch_options, tile_elems, to_output, vector_grid

_INT32_LIMIT = 2**31
_BYTES_PER_ELEM = 28
_MAX_GROUPS = 128


@triton.jit
def _cache_round_kernel(
    x_ptr, out_ptr, n_groups, groups_per_row, C, stride_x,
    FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, IDX64: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    j = tl.arange(0, GROUP)
    for tile in range(pid, tl.cdiv(n_groups, BLOCK_G), nprog):
        g = tile * BLOCK_G + tl.arange(0, BLOCK_G)
        if IDX64:
            g = g.to(tl.int64)
        row = g // groups_per_row
        col = (g % groups_per_row) * GROUP
        ok = (g < n_groups)[:, None] & ((col[:, None] + j[None, :]) < C)
        x = tl.load(x_ptr + row[:, None] * stride_x + col[:, None] + j[None, :], mask=ok, other=0.0).to(tl.float32)
        y = round_groups(x, FMT)
        tl.store(out_ptr + row[:, None] * C + col[:, None] + j[None, :], to_output(y, out_ptr), mask=ok)


def cache_round(x: torch.Tensor, *, fmt: str) -> torch.Tensor:
    if fmt not in CACHE_FORMATS:
        raise ValueError(f"cache_round fmt {fmt!r} is not one of {CACHE_FORMATS}")
    if x.dtype == torch.float64:  # no float64 on the vector units (the rounding is float32 anyway)
        return _reference(x, fmt=fmt)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    channels = x.shape[-1] if x.dim() else 1
    if x.numel() == 0:
        return out
    rows = x.reshape(-1, channels)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    group = GROUP[fmt]
    groups_per_row = cdiv(channels, group)
    n_groups = rows.shape[0] * groups_per_row
    block_g = max(1, min(_MAX_GROUPS, tile_elems(_BYTES_PER_ELEM) // group))
    idx64 = max(rows.shape[0] * max(rows.stride(0), channels), n_groups * group) >= _INT32_LIMIT
    _cache_round_kernel[(vector_grid(cdiv(n_groups, block_g)),)](
        rows, out, n_groups, groups_per_row, channels, rows.stride(0),
        FMT=fmt, GROUP=group, BLOCK_G=block_g, IDX64=idx64, **launch_options(),
    )  # fmt: skip
    return out


REGISTRATIONS = [
    Registration(
        op="cache_round",
        fn=cache_round,
        note="Triton (ascend): persistent vector grid over group tiles, float32 scale bits, integer e4m3 / midpoint e2m1 rounding (bit-exact)",
        batch_invariant=True,  # each group alone; its amax is a max
    )
]
