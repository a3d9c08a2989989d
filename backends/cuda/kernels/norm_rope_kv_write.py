"""Triton kernel: norm_rope_kv_write (a V4 compressor's emission: RMS-norm each entry, rotate its rope
channels, write it to its pool row).

One program per row, the whole row in registers (V4's 512 channels, the indexer's 128): it reads the
slot, and when the slot is non-negative loads the row's first C channels, its R rope channels and,
for the rotation, each rope channel's pair partner (channel c ^ 1: a second load of the same 16-byte
vectors instead of a shuffle across lanes), normalises in float32 (float64 for float64 rows) and
rotates with the table row of its position (`deepinfer.triton_common.norm_rope_row`), then stores
the row as kv_cache_write does: cast to the cache dtype, or quantised with the row's own scale in an
FP8 cache (`fp8_kv_row`, bit-exact with the reference on the same values). A negative slot (no window
closes, padding) masks every load and store off: its position is never read, and the host never
reads the slots (CUDA-graph safe).

Memory-bound and tiny (a decode step writes one entry per sequence): what it saves is the launches
of rms_norm, two copies, rope and kv_cache_write, and the float32 entries' round trips between them.

Deviation (interpreter only): Triton's interpreter truncates float32 -> bfloat16 casts (the GPU
rounds to nearest even, as torch does); under TRITON_INTERPRET=1 that cast is done by bit arithmetic.

Batch-invariant as it is: a row's values come from that row alone, with tiles set by C and R only.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer.ops import kv_cache_format
from deepinfer.ops.compressor import check_norm_rope_kv_write_args
from deepinfer.triton_common import fp8_kv_row, fp8_views, interpreting, last_dim_contiguous, next_power_of_2, norm_rope_row, to_bf16_rne
from deepinfer_cuda.kernels.common import Registration, pdl_launch, pdl_prologue
from deepinfer_cuda.tuning import config


@triton.jit
def _norm_rope_kv_write_kernel(
    x_ptr, w_ptr, pos_ptr, cs_ptr, cache_ptr, scale_ptr, slot_ptr,
    stride_x, stride_cs,
    stride_cache_page, stride_cache_row,
    eps,
    C: tl.constexpr, R: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr,
    ACC: tl.constexpr,
    MANUAL_RNE: tl.constexpr,  # float32 -> bfloat16 (or e4m3 with FP8) by bit arithmetic (the interpreter truncates)
    FP8: tl.constexpr,  # an FP8 cache: cache_ptr its bytes, scale_ptr the same memory as float32
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    keep = slot >= 0
    safe = tl.where(keep, slot, 0)
    row_off = (safe // PAGE) * stride_cache_page + (safe % PAGE) * stride_cache_row
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    # (a scalar mask broadcast with `&` upsets the interpreter: compare vectors instead)
    c_ok = (offs_c < C) & ((offs_c * 0 + slot) >= 0)
    r_ok = (offs_r < R) & ((offs_r * 0 + slot) >= 0)
    partner = offs_r ^ 1
    x_row = x_ptr + t * stride_x
    nope = tl.load(x_row + offs_c, mask=c_ok, other=0.0).to(ACC)
    tail = tl.load(x_row + C + offs_r, mask=r_ok, other=0.0).to(ACC)
    pair = tl.load(x_row + C + partner, mask=r_ok, other=0.0).to(ACC)
    w_nope = tl.load(w_ptr + offs_c, mask=c_ok, other=0.0).to(ACC)
    w_tail = tl.load(w_ptr + C + offs_r, mask=r_ok, other=0.0).to(ACC)
    w_pair = tl.load(w_ptr + C + partner, mask=r_ok, other=0.0).to(ACC)
    pos = tl.where(keep, tl.load(pos_ptr + t), 0).to(tl.int64)  # a skipped row's position may lie past the table
    cs_row = cs_ptr + pos * stride_cs + offs_r // 2
    cos = tl.load(cs_row, mask=r_ok, other=0.0).to(ACC)
    sin = tl.load(cs_row + R // 2, mask=r_ok, other=0.0).to(ACC)
    normed, rotated = norm_rope_row(nope, tail, pair, w_nope, w_tail, w_pair, cos, sin, (offs_r % 2) == 1, C + R, eps)
    row = cache_ptr + row_off
    if FP8:
        bl, br, scale = fp8_kv_row(normed.to(tl.float32), rotated.to(tl.float32), MANUAL_RNE)
        tl.store(row + offs_c, bl, mask=c_ok)
        tl.store(row + C + offs_r, br, mask=r_ok)
        tl.store(scale_ptr + (row_off + C + R) // 4, scale, mask=keep)
        return
    if MANUAL_RNE:
        tl.store(row + offs_c, to_bf16_rne(normed.to(tl.float32)), mask=c_ok)
        tl.store(row + C + offs_r, to_bf16_rne(rotated.to(tl.float32)), mask=r_ok)
    else:
        tl.store(row + offs_c, normed.to(cache_ptr.dtype.element_ty), mask=c_ok)
        tl.store(row + C + offs_r, rotated.to(cache_ptr.dtype.element_ty), mask=r_ok)


@lru_cache(maxsize=None)
def _config(device: torch.device) -> dict:
    return config("norm_rope_kv_write", "rows", device)


def norm_rope_kv_write(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    eps: float,
) -> torch.Tensor:
    check_norm_rope_kv_write_args(x, weight, positions, cos_sin_cache, kv_cache, slot_mapping)
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache rows must be contiguous (last stride 1)")
    rows = x.shape[0]
    if rows == 0:
        return kv_cache
    x, weight, cos_sin_cache = last_dim_contiguous(x, weight, cos_sin_cache)
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    rope_dim = cos_sin_cache.shape[-1]
    nope = x.shape[1] - rope_dim
    fp8 = kv_cache_format.is_fp8(kv_cache)
    cache, scales = fp8_views(kv_cache) if fp8 else (kv_cache, kv_cache)
    _norm_rope_kv_write_kernel[(rows,)](
        x, weight, positions, cos_sin_cache, cache, scales, slot_mapping,
        x.stride(0), cos_sin_cache.stride(0),
        cache.stride(0), cache.stride(1),
        eps,
        C=nope, R=rope_dim,
        BLOCK_C=next_power_of_2(nope), BLOCK_R=next_power_of_2(rope_dim),
        PAGE=kv_cache.shape[1],
        ACC=tl.float64 if x.dtype == torch.float64 else tl.float32,
        MANUAL_RNE=interpreting() and (fp8 or kv_cache.dtype == torch.bfloat16),
        FP8=fp8,
        num_warps=_config(kv_cache.device)["num_warps"], **pdl_launch(x.device),
    )  # fmt: skip
    return kv_cache


REGISTRATIONS = [
    Registration(
        op="norm_rope_kv_write",
        fn=norm_rope_kv_write,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        note="Triton (one program per row: norm, rope pairs by a partner load, cache write; masked skip)",
        # Batch-invariant as it is: one program per row with tiles from C and R only; the FP8 row's
        # amax is a max (exact in any order).
        batch_invariant=True,
    )
]
