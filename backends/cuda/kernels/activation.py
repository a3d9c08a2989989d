"""Triton kernels: silu_and_mul (gate then up along the last dimension).

Memory-bound: x [T, 2I] read once, out [T, I] written once. Grid: (row blocks, column blocks);
a program computes a [BLOCK_T, BLOCK_I] tile from the gate tile and the up tile I columns to its
right, in float32 (float64 for float64 inputs), with contiguous 16-byte loads along the columns.
The wrapper reads only shapes and strides: no host synchronisation (CUDA-graph safe).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer.triton_common import next_power_of_2
from deepinfer_cuda.kernels.common import Registration, num_warps_for, pdl_launch, pdl_prologue
from deepinfer_cuda.tuning import config


@triton.jit(do_not_specialize=["T"])
def _silu_and_mul_kernel(
    x_ptr, out_ptr,
    T, I,
    stride_x, stride_out,
    ACC: tl.constexpr,
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
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@lru_cache(maxsize=None)
def _config(device: torch.device) -> dict:
    return config("silu_and_mul", "rows", device)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
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
    cfg = _config(x.device)
    tile = cfg["tile_elems"]
    bucket = next_power_of_2(T)  # decides the tile: one kernel per power-of-two bucket of T (what a warm-up compiles)
    while True:  # halve the tile until the grid fills the machine (decode batches), down to min_tile_elems
        block_i = min(next_power_of_2(I), cfg["max_block_i"], tile)
        block_t = max(1, min(bucket, tile // block_i))
        programs = triton.cdiv(bucket, block_t) * triton.cdiv(I, block_i)
        if programs >= cfg.get("min_programs", 1) or tile <= cfg.get("min_tile_elems", 1) or block_t * block_i == 1:
            break
        tile //= 2
    grid = (triton.cdiv(T, block_t), triton.cdiv(I, block_i))
    num_warps = num_warps_for(block_t * block_i, x.element_size(), cfg)
    _silu_and_mul_kernel[grid](
        x2, out2, T, I, x2.stride(0), out2.stride(0),
        ACC=tl.float64 if x.dtype == torch.float64 else tl.float32,
        BLOCK_T=block_t, BLOCK_I=block_i,
        num_warps=num_warps, **pdl_launch(x2.device),
    )
    return out


REGISTRATIONS = [
    Registration(
        op="silu_and_mul",
        fn=silu_and_mul,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        note="Triton (fused gate/up tile)",
        # Batch-invariant as it is: elementwise, each output from its own gate/up pair by the same
        # instructions whatever the tile (no reduction), so the T-dependent tile changes no value.
        batch_invariant=True,
    )
]
