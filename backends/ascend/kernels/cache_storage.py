"""Ascend Triton kernels: cache_pack / cache_unpack (DeepSeek-V4.1's caches stored as code and scale bytes).

The tensor is viewed as rows of C channels and each row as groups of GROUP consecutive channels. A persistent
vector grid (`vector_grid`): each program loops over tiles of BLOCK_G groups, packed (or unpacked) by
`deepinfer.triton_cache_rounding.pack_groups` / `unpack_groups`, bit-exact with the reference (cache_round's
float32 rounding, e4m3 by integer arithmetic since A2/A3 have no float8 type, e2m1 codes by comparisons);
unpack stores rounded to nearest even (`to_output`). Buffer: as cache_round's kernel, 28 bytes a live element
(`tile_elems` keeps a tile within half the unified buffer). Offsets are int64 (a cache of 2^31 bytes is a
few million rows). float64 (a test dtype) goes to the reference. Batch-invariant as it is: each group alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.cache_rounding import GROUP
from deepinfer.ops.cache_storage import cache_pack as _reference_pack
from deepinfer.ops.cache_storage import cache_unpack as _reference_unpack
from deepinfer.triton_cache_rounding import pack_groups, pack_layout, unpack_groups, unpack_layout
from deepinfer.triton_common import cdiv
from deepinfer_ascend.kernels.common import Registration, launch_options, tile_elems, to_output, vector_grid

_BYTES_PER_ELEM = 28
_MAX_GROUPS = 128


@triton.jit
def _pack_kernel(x_ptr, rows_ptr, n_groups, groups_per_row, C, stride_x, W, FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for tile in range(pid, tl.cdiv(n_groups, BLOCK_G), nprog):
        g = tl.arange(0, BLOCK_G).to(tl.int64) + tile * BLOCK_G
        pack_groups(x_ptr, rows_ptr, g, n_groups, groups_per_row, C, stride_x, W, FMT, GROUP)


@triton.jit
def _unpack_kernel(rows_ptr, out_ptr, n_groups, groups_per_row, C, W, FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for tile in range(pid, tl.cdiv(n_groups, BLOCK_G), nprog):
        g = tl.arange(0, BLOCK_G).to(tl.int64) + tile * BLOCK_G
        values, offsets, ok = unpack_groups(rows_ptr, g, n_groups, groups_per_row, C, W, FMT, GROUP)
        tl.store(out_ptr + offsets, to_output(values, out_ptr), mask=ok)


def _block_groups(fmt: str) -> int:
    return max(1, min(_MAX_GROUPS, tile_elems(_BYTES_PER_ELEM) // GROUP[fmt]))


def cache_pack(x: torch.Tensor, *, fmt: str) -> torch.Tensor:
    if x.dtype == torch.float64:  # no float64 on the vector units (the rounding is float32 anyway)
        return _reference_pack(x, fmt=fmt)
    rows, out, groups_per_row, n_groups = pack_layout(x, fmt)
    if x.numel() == 0:
        return out
    block_g = _block_groups(fmt)
    _pack_kernel[(vector_grid(cdiv(n_groups, block_g)),)](
        rows, out, n_groups, groups_per_row, x.shape[-1], rows.stride(0), out.shape[-1], FMT=fmt, GROUP=GROUP[fmt], BLOCK_G=block_g, **launch_options(),
    )  # fmt: skip
    return out


def cache_unpack(rows: torch.Tensor, out: torch.Tensor, *, fmt: str) -> torch.Tensor:
    if out.dtype == torch.float64:
        return _reference_unpack(rows, out, fmt=fmt)
    flat_rows, dense, groups_per_row, n_groups = unpack_layout(rows, out, fmt)
    if out.numel() == 0:
        return out
    block_g = _block_groups(fmt)
    _unpack_kernel[(vector_grid(cdiv(n_groups, block_g)),)](
        flat_rows, dense, n_groups, groups_per_row, out.shape[-1], flat_rows.shape[-1], FMT=fmt, GROUP=GROUP[fmt], BLOCK_G=block_g, **launch_options(),
    )  # fmt: skip
    if dense is not out:
        out.copy_(dense)
    return out


REGISTRATIONS = [
    Registration(
        op="cache_pack",
        fn=cache_pack,
        note="Triton (ascend): persistent vector grid over group tiles, cache_round's rounding, codes and scale bytes stored (bit-exact)",
        batch_invariant=True,  # each group alone; its amax is a max
    ),
    Registration(
        op="cache_unpack",
        fn=cache_unpack,
        note="Triton (ascend): persistent vector grid over group tiles, integer e4m3 / e2m1 decode times the group's scale (bit-exact)",
        batch_invariant=True,
    ),
]
