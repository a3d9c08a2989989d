"""Triton kernels: engram_hash and engram_gate_add (DeepSeek-V4.1's Engram: hashed n-gram rows, gated addition).

engram_hash: integer work per token (M - 1 xors and (M - 1) * H remainders of int64 values): one
program per tile of BLOCK_T tokens, `deepinfer.triton_engram.engram_hash_rows`. Exact: the same int64
operations as the reference (products and xors do not overflow for the release's bounds, and with
non-negative ids the C remainder is torch's floor remainder; negative ids are outside the contract).

engram_gate_add: memory-bound, one program per tile of BLOCK_T tokens with all N streams: a first
pass over D (chunks of BLOCK_D) accumulates, per (token, stream), sum(X * q_weight * k_weight * K)
(the weights multiplied first, as the reference does), sum(X^2) and sum(K^2) in float32, lane-wise
then reduced once per chunk; the gate follows (`deepinfer.triton_engram.engram_gate`); a second pass
writes X + g * V. token_mask False gives g = 0. The sums run in another order than torch's, within
the op's float32 tolerance. float64 (a test dtype) goes to the reference.

Both are batch-invariant as they are: a token's values come from that token alone, with tiles set by
N, D, M and H only, never by T (T only chooses which program computes a token). The stores round to the
output dtype to nearest even (bit arithmetic for bfloat16 under the interpreter, whose cast truncates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.engram import check_engram_gate_args
from deepinfer.ops.engram import engram_gate_add as _gate_reference
from deepinfer.triton_common import cdiv, interpreting, next_power_of_2, to_bf16_rne
from deepinfer.triton_engram import engram_gate, engram_hash_rows
from deepinfer_cuda.kernels.common import Registration, pdl_launch, pdl_prologue

_HASH_BLOCK_T = 128
_GATE_TILE = 4096  # [BLOCK_T, N_PAD, BLOCK_D] elements per step
_GATE_MAX_BLOCK_D = 1024


@triton.jit
def _engram_hash_kernel(ids_ptr, mult_ptr, primes_ptr, offsets_ptr, out_ptr, T, stride_ids, stride_p, stride_out,
                        M: tl.constexpr, H: tl.constexpr, H_PAD: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_prologue(PDL)
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    engram_hash_rows(ids_ptr, mult_ptr, primes_ptr, offsets_ptr, out_ptr, toks, toks < T, stride_ids, stride_p, stride_out, M, H, H_PAD)


def engram_hash(ngram_ids: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if ngram_ids.dim() != 2 or multipliers.shape != (ngram_ids.shape[1],) or primes.shape != offsets.shape or primes.shape[0] != ngram_ids.shape[1] - 1:
        raise ValueError(
            f"engram_hash wants ngram_ids [T, M], multipliers [M], primes and offsets [M-1, H]; got {tuple(ngram_ids.shape)}, "
            f"{tuple(multipliers.shape)}, {tuple(primes.shape)}, {tuple(offsets.shape)}"
        )
    tokens, m = ngram_ids.shape
    heads = primes.shape[1] if primes.dim() == 2 else 0
    out = torch.empty(tokens, (m - 1) * heads, dtype=torch.int64, device=ngram_ids.device)
    if out.numel() == 0:
        return out
    ids = ngram_ids if ngram_ids.stride(1) == 1 else ngram_ids.contiguous()
    primes, offsets = primes.contiguous(), offsets.contiguous()
    _engram_hash_kernel[(cdiv(tokens, _HASH_BLOCK_T),)](
        ids, multipliers.contiguous(), primes, offsets, out, tokens, ids.stride(0), primes.stride(0), out.stride(0),
        M=m, H=heads, H_PAD=next_power_of_2(heads), BLOCK_T=_HASH_BLOCK_T, **pdl_launch(ids.device),
    )  # fmt: skip
    return out


@triton.jit
def _engram_gate_add_kernel(
    x_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, mask_ptr, out_ptr,
    T, D, stride_xt, stride_kt, stride_vt, eps,
    N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr, MANUAL_RNE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = toks < T
    n = tl.arange(0, N_PAD)
    n_ok = n < N
    dd = tl.arange(0, BLOCK_D)
    tn_ok = t_ok[:, None] & n_ok[None, :]
    dot = tl.zeros([BLOCK_T, N_PAD], tl.float32)
    sx = tl.zeros([BLOCK_T, N_PAD], tl.float32)
    sk = tl.zeros([BLOCK_T, N_PAD], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + dd
        ok = tn_ok[:, :, None] & (d < D)[None, None, :]
        col = (n[:, None] * D + d[None, :])[None, :, :]
        x = tl.load(x_ptr + toks[:, None, None] * stride_xt + col, mask=ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + toks[:, None, None] * stride_kt + col, mask=ok, other=0.0).to(tl.float32)
        w_ok = n_ok[:, None] & (d < D)[None, :]
        nd = n[:, None] * D + d[None, :]
        w = tl.load(qw_ptr + nd, mask=w_ok, other=0.0).to(tl.float32) * tl.load(kw_ptr + nd, mask=w_ok, other=0.0).to(tl.float32)
        dot += tl.sum(x * w[None, :, :] * k, axis=2)
        sx += tl.sum(x * x, axis=2)
        sk += tl.sum(k * k, axis=2)
    gate = engram_gate(dot, sx, sk, D, eps)
    if HAS_MASK:
        keep = tl.load(mask_ptr + toks, mask=t_ok, other=0).to(tl.int32) != 0
        gate = tl.where(keep[:, None], gate, 0.0)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + dd
        ok = tn_ok[:, :, None] & (d < D)[None, None, :]
        col = (n[:, None] * D + d[None, :])[None, :, :]
        x = tl.load(x_ptr + toks[:, None, None] * stride_xt + col, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + toks[:, None] * stride_vt + d[None, :], mask=t_ok[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
        y = x + gate[:, :, None] * v[:, None, :]
        dst = out_ptr + toks[:, None, None] * (N * D) + col
        if MANUAL_RNE:
            tl.store(dst, to_bf16_rne(y), mask=ok)
        else:
            tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=ok)


def engram_gate_add(
    streams: torch.Tensor,
    keys: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    *,
    eps: float,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    check_engram_gate_args(streams, keys, value, q_weight, k_weight)
    if streams.dtype == torch.float64:
        return _gate_reference(streams, keys, value, q_weight, k_weight, eps=eps, token_mask=token_mask)
    tokens, n, dim = streams.shape
    out = torch.empty(tokens, n, dim, dtype=streams.dtype, device=streams.device)
    if out.numel() == 0:
        return out
    streams, keys = (t if t.stride(2) == 1 and t.stride(1) == dim else t.contiguous() for t in (streams, keys))
    value = value if value.stride(1) == 1 else value.contiguous()
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    mask = token_mask.contiguous() if token_mask is not None else streams  # (streams: an unused pointer)
    n_pad = next_power_of_2(n)
    block_d = min(next_power_of_2(dim), _GATE_MAX_BLOCK_D)
    block_t = max(1, _GATE_TILE // (n_pad * block_d))  # from N and D only: the same compiled kernel at every T
    _engram_gate_add_kernel[(cdiv(tokens, block_t),)](
        streams, keys, value, q_weight, k_weight, mask, out,
        tokens, dim, streams.stride(0), keys.stride(0), value.stride(0), float(eps),
        N=n, N_PAD=n_pad, BLOCK_T=block_t, BLOCK_D=block_d, HAS_MASK=token_mask is not None,
        MANUAL_RNE=streams.dtype == torch.bfloat16 and interpreting(), **pdl_launch(streams.device),
    )  # fmt: skip
    return out


REGISTRATIONS = [
    Registration(
        op="engram_hash",
        fn=engram_hash,
        note="Triton: token tiles, int64 products, rolling xor and remainders per (order, head) (exact)",
        batch_invariant=True,
    ),
    Registration(
        op="engram_gate_add",
        fn=engram_gate_add,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        note="Triton: token tiles with all streams, one pass for the gate's three sums, one for X + g * V",
        batch_invariant=True,  # a token's values from that token alone (module docstring)
    ),
]
