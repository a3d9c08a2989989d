"""Ascend Triton kernel: `rope` (interleaved and half layouts; the cos/sin table row of each token's
position is gathered in the kernel, so YaRN is only a different table).

Grid: `vector_grid(n_tiles)` programs, each looping over its tiles. A tile is one token and
BLOCK_H of its heads: [BLOCK_H, BLOCK_HALF] rotation pairs (a, b): interleaved, a = x[..., 0::2]
and b = x[..., 1::2] (stride-2 accesses); half layout, a = x[..., :D/2] and b = x[..., D/2:]
(contiguous). cos/sin = cos_sin_cache[pos, :D/2] / [pos, D/2:] (contiguous, read once per tile).
out_a = a cos - b sin, out_b = b cos + a sin in float32, stored in x's dtype and layout.

Buffer budget: about 6 float32 values live per pair (a, b, the two results, cos and sin broadcast)
plus the input copies: 32 bytes x BLOCK_H x BLOCK_HALF under half the unified buffer (96 KB on
A2/A3 -> 2048 pairs, 128 KB on 950 -> 4096 pairs). Positions are loaded as int64 and used as int32
(tables are far below 2^31 entries).

float64 inputs (a test dtype; no float64 on the vector units) go to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.rope import rope as _reference
from deepinfer.triton_common import cdiv, next_power_of_2
from deepinfer_ascend.kernels.common import Registration, launch_options, tile_elems, to_output, vector_grid

_BYTES_PER_PAIR = 32


@triton.jit
def _rope_kernel(
    x_ptr, pos_ptr, cs_ptr, out_ptr,
    T, H, HALF, stride_xt, stride_xh, stride_ot, stride_oh, stride_cs,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    h_tiles = tl.cdiv(H, BLOCK_H)
    n_tiles = T * h_tiles
    heads_ar = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    if INTERLEAVED:
        a_col = 2 * i
        b_col = 2 * i + 1
    else:
        a_col = i
        b_col = i + HALF
    for tile in range(pid, n_tiles, nprog):
        t = tile // h_tiles
        heads = (tile % h_tiles) * BLOCK_H + heads_ar
        ok = (heads < H)[:, None] & i_ok[None, :]
        pos = tl.load(pos_ptr + t).to(tl.int32)
        cos = tl.load(cs_ptr + pos * stride_cs + i, mask=i_ok, other=0.0).to(tl.float32)
        sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
        xrow = x_ptr + t * stride_xt + heads[:, None] * stride_xh
        a = tl.load(xrow + a_col[None, :], mask=ok, other=0.0).to(tl.float32)
        b = tl.load(xrow + b_col[None, :], mask=ok, other=0.0).to(tl.float32)
        out_a = a * cos[None, :] - b * sin[None, :]
        out_b = b * cos[None, :] + a * sin[None, :]
        orow = out_ptr + t * stride_ot + heads[:, None] * stride_oh
        tl.store(orow + a_col[None, :], to_output(out_a, out_ptr), mask=ok)
        tl.store(orow + b_col[None, :], to_output(out_b, out_ptr), mask=ok)


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    interleaved: bool = True,
) -> torch.Tensor:
    if x.dtype == torch.float64 or x.numel() >= 2**31 or cos_sin_cache.numel() >= 2**31:
        return _reference(x, positions, cos_sin_cache, interleaved=interleaved)
    T, H, D = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return out
    half = D // 2
    xs = x if x.stride(-1) == 1 else x.contiguous()
    cs = cos_sin_cache
    if cs.dtype != torch.float32 or cs.stride(-1) != 1:
        cs = cs.to(torch.float32).contiguous()
    pos = positions.reshape(-1)
    pos = pos if pos.is_contiguous() else pos.contiguous()
    block_half = max(next_power_of_2(half), 32 // x.element_size())
    block_h = max(1, min(next_power_of_2(H), tile_elems(_BYTES_PER_PAIR) // block_half))
    n_tiles = T * cdiv(H, block_h)
    _rope_kernel[(vector_grid(n_tiles),)](
        xs, pos, cs, out,
        T, H, half, xs.stride(0), xs.stride(1), out.stride(0), out.stride(1), cs.stride(0),
        INTERLEAVED=bool(interleaved), BLOCK_H=block_h, BLOCK_HALF=block_half,
        **launch_options(),
    )
    return out


REGISTRATIONS = [
    # Invariant as it is: elementwise rotations, no reduction (BLOCK_H follows H, not T).
    Registration(
        op="rope",
        fn=rope,
        batch_invariant=True,
        note="Triton (ascend): persistent vector grid, token x head-block tiles, cos/sin rows gathered by position",
    ),
]
