"""Ascend Triton kernel: `clamped_silu_and_mul`, DeepSeek-V4's clipped SwiGLU
(x = [gate | up] -> silu(min(gate, limit)) * clamp(up, -limit, limit)).

The same memory-bound shape as silu_and_mul (activation.py). Grid: `vector_grid(n_tiles)`
programs, each looping over its tiles. A tile is BLOCK_T rows x BLOCK_I output columns: gate and
up are two contiguous loads of the same row, clamped, then silu(g) * u in float32
(silu(g) = g / (1 + exp(-g)): exp(-g) = inf for very negative g gives -0.0, no nan), stored in x's
dtype (rounded to nearest even, `to_output`). The clamps are selects on comparisons, which a NaN
fails, so NaN stays NaN as with torch.clamp. `limit` is a launch argument: one compiled kernel
serves every limit.

Buffer budget: about 7 float32 values live per output element (gate, up, both clamped, exp,
silu, out) plus the input copies and the comparison masks: 32 bytes x BLOCK_T x BLOCK_I under half
the unified buffer (2048 elements on A2/A3, 4096 on 950).

float64 inputs (a test dtype; no float64 on the vector units) and tensors of 2**31 elements or
more (int32 index arithmetic) go to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.activation import clamped_silu_and_mul as _reference
from deepinfer.triton_common import cdiv, next_power_of_2
from deepinfer_ascend.kernels.common import Registration, launch_options, tile_elems, to_output, vector_grid

_BYTES_PER_ELEM = 32
_MAX_COLS = 2048  # columns per tile: wider rows are split into several tiles


@triton.jit
def _clamped_silu_and_mul_kernel(
    x_ptr, out_ptr,
    T, I, stride_x, stride_o, limit,
    BLOCK_T: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    col_tiles = tl.cdiv(I, BLOCK_I)
    n_tiles = tl.cdiv(T, BLOCK_T) * col_tiles
    rows_ar = tl.arange(0, BLOCK_T)
    cols_ar = tl.arange(0, BLOCK_I)
    for tile in range(pid, n_tiles, nprog):
        rows = (tile // col_tiles) * BLOCK_T + rows_ar
        cols = (tile % col_tiles) * BLOCK_I + cols_ar
        ok = (rows < T)[:, None] & (cols < I)[None, :]
        src = x_ptr + rows[:, None] * stride_x + cols[None, :]
        g = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(src + I, mask=ok, other=0.0).to(tl.float32)
        g = tl.where(g > limit, limit, g)
        u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
        out = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], to_output(out, out_ptr), mask=ok)


def clamped_silu_and_mul(x: torch.Tensor, *, limit: float) -> torch.Tensor:
    if x.dtype == torch.float64 or x.numel() >= 2**31:
        return _reference(x, limit=limit)
    two_i = x.shape[-1]
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    out = torch.empty(T, inter, dtype=x.dtype, device=x.device)
    if T == 0 or inter == 0:
        return out.reshape(*x.shape[:-1], inter)
    block_i = max(min(next_power_of_2(inter), _MAX_COLS, tile_elems(_BYTES_PER_ELEM)), 32 // x.element_size())
    block_t = max(1, min(tile_elems(_BYTES_PER_ELEM) // block_i, next_power_of_2(T)))
    n_tiles = cdiv(T, block_t) * cdiv(inter, block_i)
    _clamped_silu_and_mul_kernel[(vector_grid(n_tiles),)](
        x2, out, T, inter, x2.stride(0), out.stride(0), float(limit),
        BLOCK_T=block_t, BLOCK_I=block_i,
        **launch_options(),
    )
    return out.reshape(*x.shape[:-1], inter)


REGISTRATIONS = [
    # Invariant as it is: elementwise (BLOCK_T follows T, but no value is reduced across a tile).
    Registration(
        op="clamped_silu_and_mul",
        fn=clamped_silu_and_mul,
        batch_invariant=True,
        note="Triton (ascend): persistent vector grid, row x column tiles, clamps in registers, float32 math",
    ),
]
