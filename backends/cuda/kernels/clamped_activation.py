"""Triton kernel: clamped_silu_and_mul, DeepSeek-V4's clipped SwiGLU (gate then up along the last
dimension): out = silu(min(gate, limit)) * clamp(up, -limit, limit).

The same memory-bound shape as silu_and_mul (activation.py): x [T, 2I] read once, out [T, I]
written once. Grid: (row blocks, column blocks); a program computes a [BLOCK_T, BLOCK_I] tile from
the gate tile and the up tile I columns to its right, in float32 (float64 for float64 inputs), with
contiguous 16-byte loads along the columns. Both clamps come before the multiply, as in the
reference; NaN gates or ups stay NaN as with torch.clamp (the clamps are selects on comparisons,
which NaN fails, not min/max, which drop NaN on a GPU).
`limit` is a launch argument: one compiled kernel serves every limit.

Launch constants live here (the silu_and_mul tuning entry's values: the same access pattern).
The wrapper reads only shapes and strides: no host synchronisation (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.triton_common import cdiv, interpreting, next_power_of_2, to_bf16_rne
from deepinfer_cuda.kernels.common import Registration, num_warps_for, pdl_launch, pdl_prologue

_CFG = {"max_block_i": 2048, "tile_elems": 4096, "bytes_per_thread": 32, "min_warps": 4, "max_warps": 8, "min_programs": 264, "min_tile_elems": 1024}


@triton.jit(do_not_specialize=["T"])
def _clamped_silu_and_mul_kernel(
    x_ptr, out_ptr,
    T, I,
    stride_x, stride_out,
    limit,
    ACC: tl.constexpr,
    MANUAL_RNE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_I: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    pid_t = tl.program_id(0)
    pid_i = tl.program_id(1)
    rows = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < T)[:, None] & (cols < I)[None, :]
    x_row = x_ptr + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(x_row, mask=mask, other=0.0).to(ACC)
    up = tl.load(x_row + I, mask=mask, other=0.0).to(ACC)
    gate = tl.where(gate > limit, limit, gate)  # comparisons, not min/max: NaN stays NaN as in torch.clamp
    up = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
    out = gate / (1.0 + tl.exp(-gate)) * up
    if MANUAL_RNE:
        out = to_bf16_rne(out.to(tl.float32))
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def clamped_silu_and_mul(x: torch.Tensor, *, limit: float) -> torch.Tensor:
    two_i = x.shape[-1]
    I = two_i // 2
    out = torch.empty((*x.shape[:-1], I), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    if T == 0 or I == 0:
        return out
    out2 = out.view(-1, I)
    cfg = _CFG
    tile = cfg["tile_elems"]
    bucket = next_power_of_2(T)  # decides the tile: one kernel per power-of-two bucket of T (what a warm-up compiles)
    while True:  # halve the tile until the grid fills the machine (decode batches), down to min_tile_elems
        block_i = min(next_power_of_2(I), cfg["max_block_i"], tile)
        block_t = max(1, min(bucket, tile // block_i))
        if cdiv(bucket, block_t) * cdiv(I, block_i) >= cfg["min_programs"] or tile <= cfg["min_tile_elems"] or block_t * block_i == 1:
            break
        tile //= 2
    grid = (cdiv(T, block_t), cdiv(I, block_i))
    _clamped_silu_and_mul_kernel[grid](
        x2, out2, T, I, x2.stride(0), out2.stride(0), float(limit),
        ACC=tl.float64 if x.dtype == torch.float64 else tl.float32,
        MANUAL_RNE=x.dtype == torch.bfloat16 and interpreting(),
        BLOCK_T=block_t, BLOCK_I=block_i,
        num_warps=num_warps_for(block_t * block_i, x.element_size(), cfg), **pdl_launch(x2.device),
    )
    return out


REGISTRATIONS = [
    Registration(
        op="clamped_silu_and_mul",
        fn=clamped_silu_and_mul,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        note="Triton (fused gate/up tile, clamps in registers)",
        # Batch-invariant as it is: elementwise (no reduction), so the T-dependent tile changes no value.
        batch_invariant=True,
    )
]
