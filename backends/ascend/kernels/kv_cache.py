"""Ascend Triton kernel: kv_cache_write (scatter each token's latent + rope key into its cache slot).

A vector kernel on a persistent grid: `vector_grid(T)` programs (one per vector core, never more than
there are tokens), program p handles tokens p, p + P, p + 2P, ... For each token it reads the slot
(int64 in memory, used as int32: a per-layer cache never holds 2^31 elements; the kernel switches to
int64 offsets only when the cache tensor does), and when the slot is non-negative copies kv_c[t]
([C], one contiguous row) and k_pe[t] ([R]) into row slot % block_size of page slot // block_size,
cast to the cache dtype. A negative slot (padding) skips the token with a scalar branch: nothing is
loaded or stored, and the host never reads the slots (no synchronisation).

An FP8 cache (deepinfer.ops.kv_cache_format: W e4m3 bytes, then the row's float32 scale) gets each
row quantised by the program that writes it, bit-exact with the reference: amax over latent and
rope together, scale = max(amax, 1e-4) / 448 and the values divided by it (tl.math.div_rn: IEEE
division, as torch's), each value rounded to nearest even to an e4m3 byte by integer arithmetic
(`deepinfer.triton_common.e4m3_rne_bits`: A2/A3 have no float8 type, and the same code runs under
the interpreter), the scale's 4 bytes stored after them. The kernel takes two views of the cache
(`fp8_views`): its bytes, and the same memory as float32 for the scale (a row at byte offset o
has its scale at float32 index (o + C + R) / 4).

Buffer: one [next_pow2(C)] and one [next_pow2(R)] row of the source dtype plus their casts: 2.3 KB
for C=512, R=64 in float32, far under the 192 KB (A2/A3) / 256 KB (950) unified buffer. Rows are
padded to powers of two (>= 16 elements: 32 bytes for 16-bit dtypes; >= 32 for the byte rows of an
FP8 cache) and masked. FP8 adds the float32 copies, the quotients and about four int32 temporaries
of the rounding: under 16 KB for C=512, R=64.

Deviation (interpreter only): community Triton's interpreter truncates float32 -> bfloat16 casts
(the hardware and torch round to nearest even); under TRITON_INTERPRET=1 that cast is done by bit
arithmetic (`deepinfer.triton_common.to_bf16_rne`) so the interpreter stores what the NPU would.

The reference's bounds check on the slots (a host sync) is not repeated here: the op's contract
says the non-negative slots are distinct and below num_blocks * block_size. A slot past the cache is
skipped like a negative one (the reference raises; writing it would corrupt memory past the cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops import attention as attention_ops
from deepinfer.ops import kv_cache_format
from deepinfer.triton_common import fp8_kv_row, fp8_views, interpreting, next_power_of_2, to_bf16_rne
from deepinfer_ascend.kernels.common import Registration, launch_options, vector_grid

INT32_LIMIT = 2**31


@triton.jit
def _kv_cache_write_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, scale_ptr, slot_ptr,
    num_tokens, num_slots,
    stride_c_t, stride_r_t,
    stride_cache_page, stride_cache_row,
    C: tl.constexpr, R: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr,
    IDX64: tl.constexpr,  # the cache has >= 2^31 elements: int64 row offsets
    MANUAL_RNE: tl.constexpr,  # float32 -> bfloat16 by bit arithmetic (the interpreter truncates)
    FP8: tl.constexpr,  # an FP8 cache: cache_ptr its bytes, scale_ptr the same memory as float32
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    c_ok = offs_c < C
    r_ok = offs_r < R
    for t in range(pid, num_tokens, num_programs):
        slot = tl.load(slot_ptr + t)
        if (slot >= 0) & (slot < num_slots):  # (a slot past the cache would write out of bounds: skipped too)
            if IDX64:
                dst = slot.to(tl.int64)
                tok = t.to(tl.int64)
            else:
                dst = slot.to(tl.int32)
                tok = t
            row_off = (dst // PAGE) * stride_cache_page + (dst % PAGE) * stride_cache_row
            row = cache_ptr + row_off
            latent = tl.load(kv_c_ptr + tok * stride_c_t + offs_c, mask=c_ok, other=0.0)
            rope = tl.load(k_pe_ptr + tok * stride_r_t + offs_r, mask=r_ok, other=0.0)
            if FP8:
                # (integer e4m3 rounding: A2/A3 have no float8 type)
                bl, br, scale = fp8_kv_row(latent.to(tl.float32), rope.to(tl.float32), MANUAL_CVT=True)
                tl.store(row + offs_c, bl, mask=c_ok)
                tl.store(row + C + offs_r, br, mask=r_ok)
                tl.store(scale_ptr + (row_off + C + R) // 4, scale)
            else:
                if MANUAL_RNE:
                    latent = to_bf16_rne(latent)
                    rope = to_bf16_rne(rope)
                tl.store(row + offs_c, latent.to(cache_ptr.dtype.element_ty), mask=c_ok)
                tl.store(row + C + offs_r, rope.to(cache_ptr.dtype.element_ty), mask=r_ok)


def kv_cache_write(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    num_blocks, block_size, _ = kv_cache.shape
    latent_dim, rope_dim = kv_c.shape[-1], k_pe.shape[-1]
    attention_ops.check_kv_cache_write_shapes(kv_c, k_pe, kv_cache, slot_mapping)
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache rows must be contiguous (last stride 1)")
    tokens = kv_c.shape[0]
    if tokens == 0:
        return kv_cache
    if kv_c.stride(-1) != 1:
        kv_c = kv_c.contiguous()
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    if not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.contiguous()
    big = max(kv_cache.numel() + kv_cache.stride(0), kv_c.numel() + kv_c.stride(0), k_pe.numel() + k_pe.stride(0)) >= INT32_LIMIT
    fp8 = kv_cache_format.is_fp8(kv_cache)
    cache, scales = fp8_views(kv_cache) if fp8 else (kv_cache, kv_cache)  # (scales: unused without FP8)
    manual_rne = interpreting() and kv_cache.dtype == torch.bfloat16 and torch.float32 in (kv_c.dtype, k_pe.dtype)
    if manual_rne and (kv_c.dtype != torch.float32 or k_pe.dtype != torch.float32):
        kv_c, k_pe = kv_c.float(), k_pe.float()  # (one dtype for the bit-rounding path)
    least = 32 if fp8 else 16  # a padded row of at least 32 bytes
    _kv_cache_write_kernel[(vector_grid(tokens),)](
        kv_c, k_pe, cache, scales, slot_mapping,
        tokens, num_blocks * block_size,
        kv_c.stride(0), k_pe.stride(0),
        cache.stride(0), cache.stride(1),
        C=latent_dim, R=rope_dim,
        BLOCK_C=max(least, next_power_of_2(latent_dim)), BLOCK_R=max(least, next_power_of_2(rope_dim)),
        PAGE=block_size,
        IDX64=big,
        MANUAL_RNE=manual_rne,
        FP8=fp8,
        **launch_options(),
    )
    return kv_cache


REGISTRATIONS = [
    # Invariant as it is: one token per loop iteration, its row copied (or quantised by its own amax) alone.
    Registration(
        op="kv_cache_write",
        fn=kv_cache_write,
        batch_invariant=True,
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        note="Triton (ascend) vector kernel, persistent grid over tokens, scalar skip of padding slots; FP8 rows quantised in-kernel (integer e4m3 rounding)",
    )
]
