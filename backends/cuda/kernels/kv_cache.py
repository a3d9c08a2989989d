"""Triton kernels: kv_cache_write (scatter each token's latent + rope key into its cache slot).

Memory-bound and tiny per token: one program per token reads slot_mapping[t], and, when the slot is
non-negative, copies kv_c[t] ([C]) and k_pe[t] ([R]) into row slot % block_size of page
slot // block_size, cast to the cache dtype (round to nearest even, as torch's .to). A negative slot
(padding) writes nothing: its stores are masked off, so the launch never reads slot values on the
host (CUDA-graph safe). Loads and stores are contiguous along the row (16-byte vectors).

An FP8 cache (deepinfer.ops.kv_cache_format) gets each row quantised in the same program: the
row's amax, its scale, the e4m3 bytes and the scale's 4 bytes after them, bit-exact with the
reference.

Deviation (interpreter only): Triton's interpreter truncates float32 -> bfloat16 casts (the GPU rounds
to nearest even, as torch does); under TRITON_INTERPRET=1 that cast is done by bit arithmetic instead.

The reference's bounds check on the slots (a host sync) is not repeated here: the op's contract
says the non-negative slots are distinct and below num_blocks * block_size.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer.ops import attention as attention_ops
from deepinfer.ops import kv_cache_format
from deepinfer.triton_common import fp8_kv_row, fp8_views, interpreting, next_power_of_2, to_bf16_rne
from deepinfer_cuda.kernels.common import Registration, pdl_launch, pdl_prologue
from deepinfer_cuda.tuning import config


@triton.jit
def _kv_cache_write_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, scale_ptr, slot_ptr,
    stride_c_t, stride_r_t,
    stride_cache_page, stride_cache_row,
    C: tl.constexpr, R: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr,
    MANUAL_RNE: tl.constexpr,  # float32 -> bfloat16 (or e4m3 with FP8) by bit arithmetic (the interpreter truncates)
    FP8: tl.constexpr,  # an FP8 cache: cache_ptr its bytes, scale_ptr the same memory as float32
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    keep = slot >= 0
    safe = tl.where(keep, slot, 0)
    row_off = (safe // PAGE) * stride_cache_page + (safe % PAGE) * stride_cache_row
    row = cache_ptr + row_off
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    # (a scalar mask broadcast with `&` upsets the interpreter: compare vectors instead)
    c_ok = (offs_c < C) & ((offs_c * 0 + slot) >= 0)
    r_ok = (offs_r < R) & ((offs_r * 0 + slot) >= 0)
    latent = tl.load(kv_c_ptr + t * stride_c_t + offs_c, mask=c_ok, other=0.0)
    rope = tl.load(k_pe_ptr + t * stride_r_t + offs_r, mask=r_ok, other=0.0)
    if FP8:
        bl, br, scale = fp8_kv_row(latent.to(tl.float32), rope.to(tl.float32), MANUAL_RNE)
        tl.store(row + offs_c, bl, mask=c_ok)
        tl.store(row + C + offs_r, br, mask=r_ok)
        tl.store(scale_ptr + (row_off + C + R) // 4, scale, mask=keep)
        return
    if MANUAL_RNE:
        latent = to_bf16_rne(latent)
        rope = to_bf16_rne(rope)
    tl.store(row + offs_c, latent.to(cache_ptr.dtype.element_ty), mask=c_ok)
    tl.store(row + C + offs_r, rope.to(cache_ptr.dtype.element_ty), mask=r_ok)


@lru_cache(maxsize=None)
def _config(device: torch.device) -> dict:
    return config("kv_cache_write", "tokens", device)


def kv_cache_write(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    _, block_size, _ = kv_cache.shape
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
    cfg = _config(kv_cache.device)
    fp8 = kv_cache_format.is_fp8(kv_cache)
    cache, scales = fp8_views(kv_cache) if fp8 else (kv_cache, kv_cache)
    _kv_cache_write_kernel[(tokens,)](
        kv_c, k_pe, cache, scales, slot_mapping,
        kv_c.stride(0), k_pe.stride(0),
        cache.stride(0), cache.stride(1),
        C=latent_dim, R=rope_dim,
        BLOCK_C=next_power_of_2(max(latent_dim, 1)), BLOCK_R=next_power_of_2(max(rope_dim, 1)),
        PAGE=block_size,
        MANUAL_RNE=interpreting() and (fp8 or (kv_c.dtype == torch.float32 and k_pe.dtype == torch.float32 and kv_cache.dtype == torch.bfloat16)),
        FP8=fp8,
        num_warps=cfg["num_warps"], **pdl_launch(kv_c.device),
    )
    return kv_cache


REGISTRATIONS = [
    Registration(
        op="kv_cache_write",
        fn=kv_cache_write,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        note="Triton (one program per token, masked skip)",
        # Batch-invariant as it is: one program per token with tiles from C and R only; the FP8 row's
        # amax is a max (exact in any order).
        batch_invariant=True,
    )
]
