"""Ascend Triton kernel: prefill, var-len causal flash attention over new tokens plus a cached prefix.

FlashAttention-2 forward on a persistent grid: `cube_grid(items)` programs (one per AI core), program
p runs work items p, p + P, ... An item is (query-block slot, head), head fastest. The slots come
from shapes only, `Tq // BLOCK_M + B` of them: request b owns slots `cu_seqlens_q[b] // BLOCK_M + b`
up to the next request's first slot (at least `cdiv(q_len_b, BLOCK_M)` of them); an item finds its
request by a binary search over cu_seqlens_q and does nothing when its slot is past the request's
last query block. Nothing is read back to the host. Within a request the slots run the heaviest
(last) query block first.

Each item loops over key blocks up to its causal limit (end-aligned: query i of request b sits at
key position k_len - q_len + i) and from its sliding-window start, with an online softmax in float32
(natural exp) and a float32 accumulator. Fully masked key blocks are never visited; blocks visible
to every row of the query block run without a mask, only the diagonal blocks (and the window's left
edge) apply one. K tiles are loaded row-major [BLOCK_N, D] (contiguous rows) and enter the cube
transposed (tl.trans).

Head dims: Dqk split into a power-of-two part and a remainder padded to a power of two (192 = 128 +
64: two chained dots, no padding; 64: one); Dv padded to a power of two with masks.

Buffer budget (unified buffer; all live tiles under half of it): q BLOCK_M*Dqk*e + k BLOCK_N*Dqk*e
+ v BLOCK_N*Dv*e + scores BLOCK_M*BLOCK_N*4 + p BLOCK_M*BLOCK_N*e + acc BLOCK_M*Dv*4, e = the dot
operand size. The first of (64,128), (64,64), (64,32), (32,64), (32,32), (16,32), (16,16) that fits:
  Dqk 192 / Dv 128, bf16: A2/A3 (96 KB) 64 x 32 -> 88 KB; 950 (128 KB) 64 x 64 -> 120 KB.
  Dqk 192 / Dv 128, float32: 32 x 32 -> 88 KB on both.
  Dqk 64 / Dv 64, bf16: A2/A3 64 x 64 -> 64 KB; 950 64 x 128 -> 104 KB.
Index arithmetic is int32 (IDX64 switches the row offsets to int64 when a tensor has >= 2^31
elements).

Deterministic mode (`prefill_invariant`): tiles come from the head dims, dtype and chip only, and
query and key blocks are aligned to each request's own start, so a query meets the same key blocks
in the same order however its prefill was chunked and whatever the batch holds. What does move
with the chunking is which of its key blocks take the mask-free interior loop and which the masked
one (that depends on the first query of its query block): the two loops compute a visible score
the same way in the source, but they are separately compiled code, and whether the compiler
contracts `s * sm_scale - m` or the softmax update into FMAs alike in both is not guaranteed. The
invariant kernel (MASK_ALL) folds every key block of [window start, last query] through the one
masked loop. A block wholly masked for a row leaves it exactly as it was (its weights are
exp(-inf) = 0 and alpha = exp(0) = 1), so blocks a chunking adds or skips for a row change no bit.
Cost on hardware: the mask (a compare and a select per score) on interior blocks too, a few
per cent of the vector work next to the exponentials.

Deviations (interpreter only): bf16 dot operands are upcast to float32 (deepinfer.triton_common.upcast_dot); bf16
outputs are rounded to nearest even by bit arithmetic (the interpreter truncates the cast).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer.ops import attention as attention_ops
from deepinfer.triton_common import find_request, interpreting, next_power_of_2, to_bf16_rne, upcast_dot
from deepinfer_ascend.kernels.common import Registration, cube_grid, current, dot_precision, launch_options

INT32_LIMIT = 2**31
TILE_PREFERENCE = ((64, 128), (64, 64), (64, 32), (32, 64), (32, 32), (16, 32), (16, 16))


@triton.jit
def _attend_blocks(
    acc, l_i, m_i, q1, q2,
    k_base, v_base, stride_kt, stride_vt,
    start, end, pos, k_len, window, sm_scale,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
    D_QK: tl.constexpr, D_V: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold key blocks [start, end) (BLOCK_N steps) into the running (acc, l_i, m_i)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < D_V
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < k_len
        k_rows = k_base + cols * stride_kt
        v_rows = v_base + cols * stride_vt
        d1_ok = offs_d1 < D_QK
        if MASKED:
            k1 = tl.load(k_rows[:, None] + offs_d1[None, :], mask=col_ok[:, None] & d1_ok[None, :], other=0.0)
        elif BLOCK_D1 > D_QK:
            k1 = tl.load(k_rows[:, None] + offs_d1[None, :], mask=d1_ok[None, :], other=0.0)
        else:
            k1 = tl.load(k_rows[:, None] + offs_d1[None, :])
        if DOT_F32:
            k1 = k1.to(tl.float32)
        s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
        if BLOCK_D2 > 0:
            offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
            d2_ok = offs_d2 < D_QK
            if MASKED:
                k2 = tl.load(k_rows[:, None] + offs_d2[None, :], mask=col_ok[:, None] & d2_ok[None, :], other=0.0)
            else:
                k2 = tl.load(k_rows[:, None] + offs_d2[None, :], mask=d2_ok[None, :], other=0.0)
            if DOT_F32:
                k2 = k2.to(tl.float32)
            s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
        s = s * sm_scale
        if MASKED:
            visible = (cols[None, :] <= pos[:, None]) & col_ok[None, :]
            if HAS_WINDOW:
                visible = visible & (cols[None, :] > pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        # m_i starts finite (-1e30): a row whose first tiles are wholly masked keeps exp(-inf) = 0.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(v_rows[:, None] + offs_dv[None, :], mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
        else:
            v = tl.load(v_rows[:, None] + offs_dv[None, :], mask=dv_ok[None, :], other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    num_items, num_requests, search_steps, sm_scale, window,
    H: tl.constexpr,
    D_QK: tl.constexpr, D_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    IDX64: tl.constexpr, MANUAL_RNE: tl.constexpr,
    MASK_ALL: tl.constexpr = False,  # deterministic mode: one masked loop over every key block
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < D_V
    for item in range(pid, num_items, num_programs):
        slot = item // H
        head = item % H
        b = find_request(cu_q_ptr, slot, num_requests, search_steps, BLOCK_M)
        q_start = tl.load(cu_q_ptr + b)
        q_len = tl.load(cu_q_ptr + b + 1) - q_start
        k_start = tl.load(cu_k_ptr + b)
        k_len = tl.load(cu_k_ptr + b + 1) - k_start
        num_m_blocks = tl.cdiv(q_len, BLOCK_M)
        blk = slot - (q_start // BLOCK_M + b)
        if blk < num_m_blocks:
            m_blk = num_m_blocks - 1 - blk  # the last query block (most keys) first
            rows = m_blk * BLOCK_M + offs_m  # query index within the request
            row_ok = rows < q_len
            pos = k_len - q_len + rows  # each query's key position (end-aligned causality)
            first_pos = k_len - q_len + m_blk * BLOCK_M
            last_pos = k_len - q_len + tl.minimum((m_blk + 1) * BLOCK_M, q_len) - 1

            if IDX64:
                q_row0 = (q_start + m_blk * BLOCK_M).to(tl.int64)
                k_row0 = k_start.to(tl.int64)
            else:
                q_row0 = q_start + m_blk * BLOCK_M
                k_row0 = k_start
            q_rows = q_ptr + q_row0 * stride_qt + head * stride_qh + offs_m * stride_qt
            q1 = tl.load(q_rows[:, None] + offs_d1[None, :], mask=row_ok[:, None] & (offs_d1[None, :] < D_QK), other=0.0)
            if DOT_F32:
                q1 = q1.to(tl.float32)
            if BLOCK_D2 > 0:
                offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
                q2 = tl.load(q_rows[:, None] + offs_d2[None, :], mask=row_ok[:, None] & (offs_d2[None, :] < D_QK), other=0.0)
                if DOT_F32:
                    q2 = q2.to(tl.float32)
            else:
                q2 = q1  # unused
            k_base = k_ptr + k_row0 * stride_kt + head * stride_kh
            v_base = v_ptr + k_row0 * stride_vt + head * stride_vh

            acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30

            if MASK_ALL:
                # Deterministic mode: every key block through the one masked loop (module docstring).
                if HAS_WINDOW:
                    lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
                else:
                    lo = first_pos * 0
                acc, l_i, m_i = _attend_blocks(
                    acc, l_i, m_i, q1, q2, k_base, v_base, stride_kt, stride_vt,
                    lo, last_pos + 1, pos, k_len, window, sm_scale,
                    True, HAS_WINDOW, D_QK, D_V, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV, DOT_F32, DOT_PRECISION,
                )
            else:
                # Key blocks [full_lo, diag_lo) are visible to every row of the block: no mask.
                diag_lo = (first_pos + 1) // BLOCK_N * BLOCK_N
                if HAS_WINDOW:
                    lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
                    full_lo = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
                    full_lo = tl.minimum(tl.maximum(full_lo, lo), diag_lo)
                    acc, l_i, m_i = _attend_blocks(
                        acc, l_i, m_i, q1, q2, k_base, v_base, stride_kt, stride_vt,
                        lo, full_lo, pos, k_len, window, sm_scale,
                        True, HAS_WINDOW, D_QK, D_V, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV, DOT_F32, DOT_PRECISION,
                    )
                else:
                    full_lo = diag_lo * 0
                acc, l_i, m_i = _attend_blocks(
                    acc, l_i, m_i, q1, q2, k_base, v_base, stride_kt, stride_vt,
                    full_lo, diag_lo, pos, k_len, window, sm_scale,
                    False, HAS_WINDOW, D_QK, D_V, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV, DOT_F32, DOT_PRECISION,
                )
                acc, l_i, m_i = _attend_blocks(
                    acc, l_i, m_i, q1, q2, k_base, v_base, stride_kt, stride_vt,
                    diag_lo, last_pos + 1, pos, k_len, window, sm_scale,
                    True, HAS_WINDOW, D_QK, D_V, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV, DOT_F32, DOT_PRECISION,
                )

            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # rows past q_len (never stored) may be empty
            o_rows = out_ptr + q_row0 * stride_ot + head * stride_oh + offs_m * stride_ot
            o_ptrs = o_rows[:, None] + offs_dv[None, :]
            o_mask = row_ok[:, None] & dv_ok[None, :]
            if MANUAL_RNE:
                tl.store(o_ptrs, to_bf16_rne(out), mask=o_mask)
            else:
                tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


def _split_head_dim(d: int) -> tuple[int, int]:
    """Dqk as a power-of-two part plus a remainder padded to a power of two >= 16 (0 when Dqk is one)."""
    d1 = max(16, next_power_of_2(d))
    if d1 == d or d <= 16:
        return d1, 0
    d1 //= 2
    return d1, max(next_power_of_2(d - d1), 16)


def tile_bytes(block_m: int, block_n: int, d_qk_padded: int, d_v_padded: int, e_dot: int) -> int:
    """On-chip bytes of every live tile of one program (see the module docstring)."""
    return (
        block_m * d_qk_padded * e_dot
        + block_n * d_qk_padded * e_dot
        + block_n * d_v_padded * e_dot
        + block_m * block_n * (4 + e_dot)
        + block_m * d_v_padded * 4
    )


@lru_cache(maxsize=256)
def pick_tiles(d_qk_padded: int, d_v_padded: int, e_dot: int, budget: int) -> tuple[int, int]:
    for block_m, block_n in TILE_PREFERENCE:
        if tile_bytes(block_m, block_n, d_qk_padded, d_v_padded, e_dot) <= budget:
            return block_m, block_n
    return TILE_PREFERENCE[-1]


def launch_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None,
    *,
    tiles: tuple[int, int] | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """The launcher behind `prefill`; `tiles` = (BLOCK_M, BLOCK_N) overrides the budget's choice (tests).
    invariant: every key block through the masked loop (deterministic mode)."""
    attention_ops.check_prefill_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, sliding_window)
    num_tokens, heads, d_qk = q.shape
    d_v = v.shape[2]
    out = torch.empty(num_tokens, heads, d_v, dtype=q.dtype, device=q.device)
    num_requests = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or heads == 0 or num_requests == 0:
        return out
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)

    block_d1, block_d2 = _split_head_dim(d_qk)
    block_dv = max(16, next_power_of_2(d_v))
    dot_f32 = q.dtype == torch.float32 or len({q.dtype, k.dtype, v.dtype}) > 1
    e_dot = 4 if dot_f32 else q.element_size()
    if tiles is None:
        tiles = pick_tiles(block_d1 + block_d2, block_dv, e_dot, current().ub_bytes // 2)
    block_m, block_n = tiles
    items = (num_tokens // block_m + num_requests) * heads
    big = max(x.numel() + x.stride(0) for x in (q, k, v, out)) >= INT32_LIMIT
    upcast = dot_f32 or upcast_dot()
    _prefill_kernel[(cube_grid(items),)](
        q, k, v, out, cu_q, cu_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        items, num_requests, max(num_requests - 1, 0).bit_length(), float(softmax_scale), int(sliding_window or 0),
        H=heads, D_QK=d_qk, D_V=d_v,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D1=block_d1, BLOCK_D2=block_d2, BLOCK_DV=block_dv,
        HAS_WINDOW=sliding_window is not None,
        DOT_F32=upcast, DOT_PRECISION=dot_precision(upcast),
        IDX64=big, MANUAL_RNE=interpreting() and q.dtype == torch.bfloat16,
        MASK_ALL=invariant,
        **launch_options(),
    )
    return out


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    return launch_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, sliding_window)


def prefill_invariant(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    return launch_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, sliding_window, invariant=True)


REGISTRATIONS = [
    Registration(
        op="prefill",
        fn=prefill,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        note="Triton (ascend) FA2 var-len causal, persistent cube grid over (query block, head), mask-free interior blocks",
    ),
    Registration(
        op="prefill",
        fn=prefill_invariant,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        priority=-1,
        batch_invariant=True,
        note="Triton (ascend) the kernel above with every key block through one masked loop (no mask-free interior path)",
    ),
]
