"""Ascend Triton kernel: head_norm_rope (DeepSeek-V4's query heads: RMS-normed without weight, their rope
channels rotated, in place).

A vector kernel on a persistent grid: `vector_grid(items)` programs over (token, head block) items,
program p handles items p, p + P, ... An item holds BLOCK_H whole heads of one token ([BLOCK_H,
next_power_of_2(D)], padded to at least 16 channels and masked), loads each rope channel's pair
partner (channel c ^ 1: a second gather of the same bytes instead of a shuffle across lanes), takes
each head's sum of squares in float32, rounds the normed head to x's dtype (`to_output`: nearest
even, as rms_norm's output is), rotates the tail with the token's table row and stores the head
back. The position is read on the device (no host synchronisation).

Buffer: about 8 float32 values per channel of the tile (x, partner, the normed pair, cos, sin, the
rotation), `tile_elems(32)` channels in all: whole heads per item, at least one.

Batch-invariant as it is: a head from itself alone, with tiles from H, D and the chip only.
float64 x (a test dtype; no float64 on the vector units) goes to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.rope import check_head_norm_rope_args
from deepinfer.ops.rope import head_norm_rope as _reference
from deepinfer.triton_common import cdiv, next_power_of_2
from deepinfer_ascend.kernels.common import Registration, launch_options, tile_elems, to_output, vector_grid

_BYTES_PER_ELEM = 32


@triton.jit
def _head_norm_rope_kernel(
    x_ptr, pos_ptr, cs_ptr,
    T, H, stride_t, stride_h, stride_cs,
    eps,
    D: tl.constexpr, R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    blocks = tl.cdiv(H, BLOCK_H)
    c = tl.arange(0, BLOCK_D)
    c_ok = c < D
    tail = c_ok & (c >= D - R)
    j = tl.where(tail, (c - (D - R)) // 2, 0)
    sign = tl.where(c % 2 == 1, 1.0, -1.0)
    for item in range(pid, T * blocks, num_programs):
        t = item // blocks
        heads = (item % blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = heads < H
        rows = x_ptr + t.to(tl.int64) * stride_t + heads.to(tl.int64)[:, None] * stride_h
        mask = h_ok[:, None] & c_ok[None, :]
        x = tl.load(rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
        pair = tl.load(rows + (c ^ 1)[None, :], mask=h_ok[:, None] & tail[None, :], other=0.0).to(tl.float32)
        if NORM:  # the normed head rounded to x's dtype, as rms_norm stores it before rope reads it
            inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
            x = to_output(x * inv[:, None], x_ptr).to(tl.float32)
            pair = to_output(pair * inv[:, None], x_ptr).to(tl.float32)
        pos = tl.load(pos_ptr + t).to(tl.int32)  # (tables are far below 2^31 entries)
        cos = tl.load(cs_ptr + pos * stride_cs + j, mask=tail, other=1.0).to(tl.float32)
        sin = tl.load(cs_ptr + pos * stride_cs + R // 2 + j, mask=tail, other=0.0).to(tl.float32)
        rotated = x * cos[None, :] + sign[None, :] * (pair * sin[None, :])
        tl.store(rows + c[None, :], to_output(tl.where(tail[None, :], rotated, x), x_ptr), mask=mask)


def head_norm_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    eps: float | None = None,
) -> torch.Tensor:
    check_head_norm_rope_args(x, positions, cos_sin_cache)
    if x.dtype == torch.float64:
        return _reference(x, positions, cos_sin_cache, eps=eps)
    if x.stride(-1) != 1:
        raise ValueError("head_norm_rope writes x in place: its last dimension must be contiguous")
    T, H, D = x.shape
    if T == 0 or H == 0:
        return x
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    pos = positions.contiguous()
    block_d = max(16, next_power_of_2(D))
    block_h = max(1, min(next_power_of_2(H), tile_elems(_BYTES_PER_ELEM) // block_d))
    _head_norm_rope_kernel[(vector_grid(T * cdiv(H, block_h)),)](
        x, pos, cs,
        T, H, x.stride(0), x.stride(1), cs.stride(0),
        0.0 if eps is None else float(eps),
        D=D, R=cs.shape[-1],
        BLOCK_H=block_h, BLOCK_D=block_d,
        NORM=eps is not None,
        **launch_options(),
    )  # fmt: skip
    return x


REGISTRATIONS = [
    # Invariant as it is: a head per row of the item's tile, normed and rotated from itself alone.
    Registration(
        op="head_norm_rope",
        fn=head_norm_rope,
        batch_invariant=True,
        note="Triton (ascend) vector kernel, persistent grid over (token, head block): weightless norm, rope pairs by a partner gather, in place",
    )
]
