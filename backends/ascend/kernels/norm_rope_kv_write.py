"""Ascend Triton kernel: norm_rope_kv_write (a V4 compressor's emission: RMS-norm each entry, rotate its
rope channels, write it to its pool row).

A vector kernel on a persistent grid: `vector_grid(T)` programs (one per vector core, never more than
there are rows), program p handles rows p, p + P, p + 2P, ... For each row it reads the slot (int64 in
memory, used as int32 unless the cache or x has 2^31 elements), and when the slot is non-negative
loads the row's first C channels, its R rope channels and each rope channel's pair partner (channel
c ^ 1: a second gather of the same 2R bytes instead of a shuffle across lanes), normalises in float32
and rotates with the table row of its position (`deepinfer.triton_common.norm_rope_row`), then stores
the row as kv_cache_write does: rounded to the cache dtype (`to_output`: nearest even), or, in an FP8
cache, quantised with the row's own scale by integer e4m3 rounding (`fp8_kv_row`; A2/A3 have no
float8 type), the scale's 4 bytes after the values. A negative slot (no window closes, padding)
skips the row with a scalar branch: nothing is loaded, its position is never read, and the host
never reads the slots (no synchronisation).

Buffer: the row's values, partners, weights and table entries in float32, about 10 values per
channel: 20 KB for C=448, R=64, far under the 192 KB (A2/A3) / 256 KB (950) unified buffer. Rows are
padded to powers of two (>= 16 elements, >= 32 for an FP8 cache's byte rows) and masked.

Batch-invariant as it is: one row per loop iteration, computed alone with tiles from C and R only.
float64 rows (a test dtype; no float64 on the vector units) go to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops import kv_cache_format
from deepinfer.ops.compressor import check_norm_rope_kv_write_args
from deepinfer.ops.compressor import norm_rope_kv_write as _reference
from deepinfer.triton_common import fp8_kv_row, fp8_views, last_dim_contiguous, next_power_of_2, norm_rope_row
from deepinfer_ascend.kernels.common import Registration, launch_options, to_output, vector_grid

INT32_LIMIT = 2**31


@triton.jit
def _norm_rope_kv_write_kernel(
    x_ptr, w_ptr, pos_ptr, cs_ptr, cache_ptr, scale_ptr, slot_ptr,
    num_rows, num_slots,
    stride_x, stride_cs,
    stride_cache_page, stride_cache_row,
    eps,
    C: tl.constexpr, R: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr,
    IDX64: tl.constexpr,  # the cache or x has >= 2^31 elements: int64 offsets
    FP8: tl.constexpr,  # an FP8 cache: cache_ptr its bytes, scale_ptr the same memory as float32
):  # fmt: skip
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    c_ok = offs_c < C
    r_ok = offs_r < R
    partner = offs_r ^ 1
    odd = (offs_r % 2) == 1
    w_nope = tl.load(w_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    w_tail = tl.load(w_ptr + C + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    w_pair = tl.load(w_ptr + C + partner, mask=r_ok, other=0.0).to(tl.float32)
    for t in range(pid, num_rows, num_programs):
        slot = tl.load(slot_ptr + t)
        if (slot >= 0) & (slot < num_slots):  # (a slot past the cache would write out of bounds: skipped too)
            if IDX64:
                dst = slot.to(tl.int64)
                row_t = t.to(tl.int64)
            else:
                dst = slot.to(tl.int32)
                row_t = t
            x_row = x_ptr + row_t * stride_x
            nope = tl.load(x_row + offs_c, mask=c_ok, other=0.0).to(tl.float32)
            tail = tl.load(x_row + C + offs_r, mask=r_ok, other=0.0).to(tl.float32)
            pair = tl.load(x_row + C + partner, mask=r_ok, other=0.0).to(tl.float32)
            pos = tl.load(pos_ptr + t).to(tl.int32)  # (tables are far below 2^31 entries)
            cs_row = cs_ptr + pos * stride_cs + offs_r // 2
            cos = tl.load(cs_row, mask=r_ok, other=0.0).to(tl.float32)
            sin = tl.load(cs_row + R // 2, mask=r_ok, other=0.0).to(tl.float32)
            normed, rotated = norm_rope_row(nope, tail, pair, w_nope, w_tail, w_pair, cos, sin, odd, C + R, eps)
            row_off = (dst // PAGE) * stride_cache_page + (dst % PAGE) * stride_cache_row
            row = cache_ptr + row_off
            if FP8:
                bl, br, scale = fp8_kv_row(normed, rotated, MANUAL_CVT=True)
                tl.store(row + offs_c, bl, mask=c_ok)
                tl.store(row + C + offs_r, br, mask=r_ok)
                tl.store(scale_ptr + (row_off + C + R) // 4, scale)
            else:
                tl.store(row + offs_c, to_output(normed, cache_ptr), mask=c_ok)
                tl.store(row + C + offs_r, to_output(rotated, cache_ptr), mask=r_ok)


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
    if x.dtype == torch.float64:
        return _reference(x, weight, positions, cos_sin_cache, kv_cache, slot_mapping, eps=eps)
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache rows must be contiguous (last stride 1)")
    rows = x.shape[0]
    if rows == 0:
        return kv_cache
    x, weight, cos_sin_cache = last_dim_contiguous(x, weight, cos_sin_cache)
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    num_blocks, block_size, _ = kv_cache.shape
    rope_dim = cos_sin_cache.shape[-1]
    nope = x.shape[1] - rope_dim
    big = max(kv_cache.numel() + kv_cache.stride(0), x.numel() + x.stride(0)) >= INT32_LIMIT
    fp8 = kv_cache_format.is_fp8(kv_cache)
    cache, scales = fp8_views(kv_cache) if fp8 else (kv_cache, kv_cache)  # (scales: unused without FP8)
    least = 32 if fp8 else 16  # a padded row of at least 32 bytes
    _norm_rope_kv_write_kernel[(vector_grid(rows),)](
        x, weight, positions, cos_sin_cache, cache, scales, slot_mapping,
        rows, num_blocks * block_size,
        x.stride(0), cos_sin_cache.stride(0),
        cache.stride(0), cache.stride(1),
        eps,
        C=nope, R=rope_dim,
        BLOCK_C=max(least, next_power_of_2(nope)), BLOCK_R=max(least, next_power_of_2(rope_dim)),
        PAGE=block_size,
        IDX64=big,
        FP8=fp8,
        **launch_options(),
    )  # fmt: skip
    return kv_cache


REGISTRATIONS = [
    # Invariant as it is: one row per loop iteration, normed, rotated and stored (or quantised by its own amax) alone.
    Registration(
        op="norm_rope_kv_write",
        fn=norm_rope_kv_write,
        batch_invariant=True,
        note="Triton (ascend) vector kernel, persistent grid over rows: norm, rope pairs by a partner gather, cache write; scalar skip",
    )
]
