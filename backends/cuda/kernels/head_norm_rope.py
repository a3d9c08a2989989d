"""Triton kernel: head_norm_rope (DeepSeek-V4's query heads: RMS-normed without weight, their rope
channels rotated, in place).

Grid (tokens, head blocks): a program holds BLOCK_H whole heads of one token in registers ([BLOCK_H,
next_power_of_2(D)]: V4's 512 channels, the indexer's 128), loads each rope channel's pair partner
(channel c ^ 1: a second load of the same 16-byte vectors instead of a shuffle across lanes), takes
each head's sum of squares in float32 (float64 for float64 x), rounds the normed head to x's dtype
(as rms_norm's output is), rotates the tail with the token's table row and stores the head back.
The position is read on the device (no host synchronisation: CUDA-graph safe).

Memory-bound and tiny at decode: what it saves is the launches of rms_norm, rope and the copy of the
rotated tail back into the head (and their round trips through memory).

Deviation (interpreter only): Triton's interpreter truncates float32 -> bfloat16 casts (the GPU
rounds to nearest even, as torch does); under TRITON_INTERPRET=1 that cast is done by bit arithmetic,
and a program holds more heads (the interpreter pays per operation, not per element).

Batch-invariant as it is: a head's values come from that head alone, with tiles set by H and D only.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer.ops.rope import check_head_norm_rope_args
from deepinfer.triton_common import cdiv, interpreting, next_power_of_2, to_bf16_rne
from deepinfer_cuda.kernels.common import Registration, pdl_launch, pdl_prologue
from deepinfer_cuda.tuning import config


@triton.jit
def _rounded(v, x_ptr, MANUAL_RNE: tl.constexpr):
    """v rounded to x's element type (nearest even; by bit arithmetic for bfloat16 under the interpreter)."""
    if MANUAL_RNE:
        r = to_bf16_rne(v.to(tl.float32))
    else:
        r = v.to(x_ptr.dtype.element_ty)
    return r


@triton.jit
def _head_norm_rope_kernel(
    x_ptr, pos_ptr, cs_ptr,
    H, stride_t, stride_h, stride_cs,
    eps,
    D: tl.constexpr, R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    NORM: tl.constexpr,
    MANUAL_RNE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_D)
    h_ok = heads < H
    c_ok = c < D
    tail = c_ok & (c >= D - R)
    rows = x_ptr + t * stride_t + heads.to(tl.int64)[:, None] * stride_h
    mask = h_ok[:, None] & c_ok[None, :]
    x = tl.load(rows + c[None, :], mask=mask, other=0.0).to(ACC)
    pair = tl.load(rows + (c ^ 1)[None, :], mask=h_ok[:, None] & tail[None, :], other=0.0).to(ACC)
    if NORM:  # the normed head rounded to x's dtype, as rms_norm stores it before rope reads it
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        x = _rounded(x * inv[:, None], x_ptr, MANUAL_RNE).to(ACC)
        pair = _rounded(pair * inv[:, None], x_ptr, MANUAL_RNE).to(ACC)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.where(tail, (c - (D - R)) // 2, 0)
    cos = tl.load(cs_ptr + pos * stride_cs + j, mask=tail, other=1.0).to(ACC)
    sin = tl.load(cs_ptr + pos * stride_cs + R // 2 + j, mask=tail, other=0.0).to(ACC)
    # lane 2i: a cos - b sin; lane 2i+1: b cos + a sin (a = x[2i], b = x[2i+1]), as rope computes them
    rotated = x * cos[None, :] + tl.where(c % 2 == 1, 1.0, -1.0)[None, :] * (pair * sin[None, :])
    out = tl.where(tail[None, :], rotated, x)
    tl.store(rows + c[None, :], _rounded(out, x_ptr, MANUAL_RNE), mask=mask)


@lru_cache(maxsize=None)
def _config(device: torch.device) -> dict:
    return config("head_norm_rope", "heads", device)


def head_norm_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    eps: float | None = None,
) -> torch.Tensor:
    check_head_norm_rope_args(x, positions, cos_sin_cache)
    if x.stride(-1) != 1:
        raise ValueError("head_norm_rope writes x in place: its last dimension must be contiguous")
    T, H, D = x.shape
    if T == 0 or H == 0:
        return x
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    pos = positions if positions.stride(0) == 1 else positions.contiguous()
    cfg = _config(x.device)
    block_d = next_power_of_2(D)
    tile = cfg["interpreter_tile_elems"] if interpreting() else cfg["tile_elems"]
    block_h = max(1, min(next_power_of_2(H), tile // block_d))
    _head_norm_rope_kernel[(T, cdiv(H, block_h))](
        x, pos, cs,
        H, x.stride(0), x.stride(1), cs.stride(0),
        0.0 if eps is None else float(eps),
        D=D, R=cs.shape[-1],
        BLOCK_H=block_h, BLOCK_D=block_d,
        ACC=tl.float64 if x.dtype == torch.float64 else tl.float32,
        NORM=eps is not None,
        MANUAL_RNE=interpreting() and x.dtype == torch.bfloat16,
        num_warps=cfg["num_warps"], **pdl_launch(x.device),
    )  # fmt: skip
    return x


REGISTRATIONS = [
    Registration(
        op="head_norm_rope",
        fn=head_norm_rope,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        note="Triton (a token's head block per program: weightless norm, rope pairs by a partner load, in place)",
        # Batch-invariant as it is: a head from itself alone, tiles from H and D only.
        batch_invariant=True,
    )
]
