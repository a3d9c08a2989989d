"""Triton helpers for DeepSeek-V4.1's Engram ops (deepinfer.ops.engram): what a tile computes, shared by the
cuda and ascend kernels (which differ only in how they cut the work into programs). Backend-neutral like
`deepinfer.triton_common`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def engram_hash_rows(ids_ptr, mult_ptr, primes_ptr, offsets_ptr, out_ptr, toks, t_ok, stride_ids, stride_p, stride_out,
                     M: tl.constexpr, H: tl.constexpr, H_PAD: tl.constexpr):  # fmt: skip
    """engram_hash for the tokens `toks` (mask t_ok): x_n = p_0 ^ .. ^ p_{n-1} with p_j = ids[:, j] * mult[j]
    (int64, in order j = 0, 1, ..), and out[:, (n-2) * H + h] = x_n % primes[n-2, h] + offsets[n-2, h]
    (operands non-negative: a C remainder equals torch's floor remainder)."""
    h = tl.arange(0, H_PAD)
    h_ok = h < H
    rolling = tl.load(ids_ptr + toks * stride_ids, mask=t_ok, other=0).to(tl.int64) * tl.load(mult_ptr).to(tl.int64)
    for n in tl.static_range(1, M):
        p = tl.load(ids_ptr + toks * stride_ids + n, mask=t_ok, other=0).to(tl.int64) * tl.load(mult_ptr + n).to(tl.int64)
        rolling = rolling ^ p
        prime = tl.load(primes_ptr + (n - 1) * stride_p + h, mask=h_ok, other=1).to(tl.int64)
        first = tl.load(offsets_ptr + (n - 1) * stride_p + h, mask=h_ok, other=0).to(tl.int64)
        rows = rolling[:, None] % prime[None, :] + first[None, :]
        tl.store(out_ptr + toks[:, None] * stride_out + ((n - 1) * H + h)[None, :], rows, mask=t_ok[:, None] & h_ok[None, :])


@triton.jit
def engram_gate(dot, sum_x2, sum_k2, D, eps):
    """The gate of each (token, stream) from sum(X * q_weight * k_weight * K), sum(X^2) and sum(K^2) over D
    channels: sigmoid(sign(d) * sqrt(max(|d|, 1e-6))) with d = dot * rsqrt(mean(X^2) + eps) *
    rsqrt(mean(K^2) + eps) / sqrt(D), in the reference's order of operations."""
    rstd = (1.0 / tl.sqrt(sum_x2 / D + eps)) * (1.0 / tl.sqrt(sum_k2 / D + eps))
    d = dot * rstd * (1.0 / tl.sqrt(D * 1.0))
    root = tl.sqrt(tl.maximum(tl.abs(d), 1e-6))
    return 1.0 / (1.0 + tl.exp(-tl.where(d < 0, -root, root)))
