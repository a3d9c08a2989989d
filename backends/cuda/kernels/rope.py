"""Triton kernels: rope (interleaved and half layouts), reading cos/sin from the table by position.

Memory-bound: x is read once and the rotated copy written once; the table row of a token is read
once per program (it stays in L1/L2 for the token's other head blocks). Grid: (token blocks,
head blocks); a program rotates a [BLOCK_T tokens x BLOCK_H heads x D] tile.

- interleaved: the tile is loaded contiguously ([.., BLOCK_D] with 16-byte vectors), reshaped to
  [.., BLOCK_D/2, 2] and split into the even/odd lanes; the rotated halves are joined back the
  same way, so loads and stores stay contiguous.
- half: the two halves x[:D/2] and x[D/2:] are two contiguous loads.

Positions are read on the device (no host synchronisation: CUDA-graph safe). x may be a strided
view (e.g. the rope part of q), as long as its last dimension is contiguous.
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
def _rope_kernel(
    x_ptr, pos_ptr, cs_ptr, out_ptr,
    T, H, D,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cs,
    INTERLEAVED: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    half = D // 2
    tok = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    tok_ok = tok < T
    head_ok = heads < H
    j_ok = j < half
    pos = tl.load(pos_ptr + tok, mask=tok_ok, other=0).to(tl.int64)
    cs_row = cs_ptr + pos[:, None] * stride_cs
    cs_mask = tok_ok[:, None] & j_ok[None, :]
    cos = tl.load(cs_row + j[None, :], mask=cs_mask, other=0.0).to(ACC)[:, None, :]  # [BT, 1, BHALF]
    sin = tl.load(cs_row + half + j[None, :], mask=cs_mask, other=0.0).to(ACC)[:, None, :]
    th_ok = tok_ok[:, None, None] & head_ok[None, :, None]
    x_base = x_ptr + tok[:, None, None] * stride_xt + heads[None, :, None].to(tl.int64) * stride_xh
    o_base = out_ptr + tok[:, None, None] * stride_ot + heads[None, :, None].to(tl.int64) * stride_oh
    if INTERLEAVED:
        d = tl.arange(0, 2 * BLOCK_HALF)
        mask = th_ok & (d < D)[None, None, :]
        x = tl.load(x_base + d[None, None, :], mask=mask, other=0.0).to(ACC)
        a, b = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_H, BLOCK_HALF, 2)))
        out = tl.reshape(tl.join(a * cos - b * sin, b * cos + a * sin), (BLOCK_T, BLOCK_H, 2 * BLOCK_HALF))
        tl.store(o_base + d[None, None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        mask = th_ok & j_ok[None, None, :]
        a = tl.load(x_base + j[None, None, :], mask=mask, other=0.0).to(ACC)
        b = tl.load(x_base + half + j[None, None, :], mask=mask, other=0.0).to(ACC)
        tl.store(o_base + j[None, None, :], (a * cos - b * sin).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(o_base + half + j[None, None, :], (b * cos + a * sin).to(out_ptr.dtype.element_ty), mask=mask)


@lru_cache(maxsize=None)
def _config(device: torch.device) -> dict:
    return config("rope", "tokens", device)


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    interleaved: bool = True,
) -> torch.Tensor:
    T, H, D = x.shape
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T == 0 or H == 0 or D == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    pos = positions if positions.stride(0) == 1 else positions.contiguous()
    cfg = _config(x.device)
    block_half = next_power_of_2(D // 2)
    tile = cfg["tile_elems"]
    # Halve the tile until the grid fills the machine (decode batches), down to min_tile_elems; decided
    # for T rounded up to a power of two, so that every T of one bucket compiles one kernel (the
    # start-up warm-up's power-of-two steps compile them all).
    bucket = next_power_of_2(T)
    while True:
        block_h = max(1, min(next_power_of_2(H), tile // (2 * block_half)))
        block_t = max(1, min(bucket, tile // (block_h * 2 * block_half)))
        programs = triton.cdiv(bucket, block_t) * triton.cdiv(H, block_h)
        if programs >= cfg.get("min_programs", 1) or tile <= cfg.get("min_tile_elems", 1) or block_t * block_h == 1:
            break
        tile //= 2
    grid = (triton.cdiv(T, block_t), triton.cdiv(H, block_h))
    num_warps = num_warps_for(block_t * block_h * 2 * block_half, x.element_size(), cfg)
    _rope_kernel[grid](
        x, pos, cs, out, T, H, D,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cs.stride(0),
        INTERLEAVED=bool(interleaved), ACC=tl.float64 if x.dtype == torch.float64 else tl.float32,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=block_half,
        num_warps=num_warps, **pdl_launch(x.device),
    )
    return out


REGISTRATIONS = [
    Registration(
        op="rope",
        fn=rope,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        note="Triton (table lookup by position, interleaved/half)",
        # Batch-invariant as it is: elementwise per (token, head, pair) from the token's own position
        # (no reduction), so the T-dependent tile changes no value.
        batch_invariant=True,
    )
]
