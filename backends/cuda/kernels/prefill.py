"""Triton kernel: `prefill`, var-len causal flash attention over new tokens plus a cached prefix.

FlashAttention-2 forward: one program per (query block of one request, head); it loops over the
key blocks up to its causal limit (and from its sliding-window start), keeping a running max and
sum (online softmax) and a float32 accumulator. Fully masked key blocks are never visited; blocks
that need no mask run a mask-free loop, only the blocks on the diagonal (and at the window's left
edge) apply the mask.

Grid from shapes only: axis 0 has `Tq // BLOCK_M + B` slots, enough for every request's query
blocks (request b owns slots `cu_seqlens_q[b] // BLOCK_M + b` up to the next request's first slot,
at least `cdiv(q_len_b, BLOCK_M)` of them); a program finds its request by a binary search over
`cu_seqlens_q` and returns at once if its slot is past the request's last block. Within a request
the slots run the heaviest (last) query block first. Nothing is read back to the host.

Head dims: Dqk need not be a power of two. It is split into a power-of-two part and a remainder
padded to a power of two (192 = 128 + 64 exactly, two chained dots; 80 = 64 + 16; 112 = 64 + 64
with the last 16 columns masked); Dv is padded to a power of two with masks.

K/V tiles: plain masked pointer loads, or (tuning entry `tma`, SM90/SM100 tables) TMA loads
through host-side descriptors over the [Tk, H * D] views of packed k/v; rows past a request's keys
then come from the next request (or zero fill past Tk) and get probability 0 through the score mask.
The pointer path serves strided inputs and the default table (the interpreter). `warp_specialize`
(tl.range) is an option the tables leave off: Triton 3.6 fails to compile it for this loop on SM90.

Deterministic mode (`prefill_invariant`): a query's key blocks are aligned to its request's key
position 0 and the tiles come from the head dims and dtype only, so the blocks it visits and their
order do not depend on the batch; a block wholly masked for a row (past its position, before its
window) leaves its (m, l, acc) exactly as they were (p = 0, alpha = 1). What does depend on how the
queries were cut into query blocks (chunked prefill, a cached prefix) is which of a row's blocks
run mask-free: that path computes exp2(s * scale - m) as one FMA on a GPU, the masked one rounds
s * scale first. The invariant kernel runs every key block through the masked path (MASK_ALL), so a
row's arithmetic is the same whichever query block holds it. The interpreter (numpy, no FMA) gives
both paths the same bits, so only a GPU can show the difference.

Deviation (interpreter only): dot operands are upcast to float32 under TRITON_INTERPRET=1
(deepinfer.triton_common.upcast_dot); float32 operands use input_precision="ieee". The H200
figures are in docs/performance.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops import attention as attention_ops
from deepinfer.triton_common import find_request, next_power_of_2, upcast_dot
from deepinfer_cuda.kernels.common import Registration, dot_precision, pdl_launch, pdl_prologue
from deepinfer_cuda.tuning import config

LOG2E = 1.4426950408889634


@triton.jit
def _attend_blocks(
    acc, l_i, m_i, q1, q2,
    k_base, v_base, stride_kt, stride_vt,
    k_desc1, k_desc2, v_desc, k_start, head,
    start, end, pos, k_len, window, qk_scale,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, USE_DESC: tl.constexpr, WARP_SPEC: tl.constexpr, POS_SCALE: tl.constexpr,
    D_QK: tl.constexpr, D_V: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold key blocks [start, end) (in BLOCK_N steps) into the running (acc, l_i, m_i)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < D_V
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
        d2_ok = offs_d2 < D_QK
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPEC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        col_ok = cols < k_len
        if USE_DESC:
            # TMA tiles over the [Tk, H * D] view. Rows past this request's keys (the next
            # request's, or zero-filled past Tk) get probability 0 through the score mask.
            k1 = k_desc1.load([k_start + start_n, head * D_QK]).T
        else:
            k_blk = k_base + start_n.to(tl.int64) * stride_kt
            v_blk = v_base + start_n.to(tl.int64) * stride_vt
            # K tiles are loaded transposed, [D, BLOCK_N]: the dot is q [M, D] x k^T [D, N].
            k_ptrs1 = k_blk + offs_n[None, :] * stride_kt + offs_d1[:, None]
            if MASKED:
                k1 = tl.load(k_ptrs1, mask=col_ok[None, :], other=0.0)
            else:
                k1 = tl.load(k_ptrs1)
        if DOT_F32:
            k1 = k1.to(tl.float32)
        s = tl.dot(q1, k1, input_precision=DOT_PRECISION)
        if BLOCK_D2 > 0:
            if USE_DESC:
                k2 = k_desc2.load([k_start + start_n, head * D_QK + BLOCK_D1]).T
            else:
                k_ptrs2 = k_blk + offs_n[None, :] * stride_kt + offs_d2[:, None]
                if MASKED:
                    if BLOCK_D1 + BLOCK_D2 == D_QK:
                        k2 = tl.load(k_ptrs2, mask=col_ok[None, :], other=0.0)
                    else:
                        k2 = tl.load(k_ptrs2, mask=col_ok[None, :] & d2_ok[:, None], other=0.0)
                else:
                    if BLOCK_D1 + BLOCK_D2 == D_QK:
                        k2 = tl.load(k_ptrs2)
                    else:
                        k2 = tl.load(k_ptrs2, mask=d2_ok[:, None], other=0.0)
            if DOT_F32:
                k2 = k2.to(tl.float32)
            s = tl.dot(q2, k2, s, input_precision=DOT_PRECISION)
        # log2 domain: qk_scale = softmax_scale * log2(e)
        if MASKED:
            s = s * qk_scale
            visible = (cols[None, :] <= pos[:, None]) & col_ok[None, :]
            if HAS_WINDOW:
                visible = visible & (cols[None, :] > pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        elif POS_SCALE:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])  # one FMA per score
        else:
            s = s * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_DESC:
            v = v_desc.load([k_start + start_n, head * D_V])
        else:
            v_ptrs = v_blk + offs_n[:, None] * stride_vt + offs_dv[None, :]
            if MASKED:
                if BLOCK_DV == D_V:
                    v = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
                else:
                    v = tl.load(v_ptrs, mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
            else:
                if BLOCK_DV == D_V:
                    v = tl.load(v_ptrs)
                else:
                    v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_requests", "search_steps"])
def _prefill_kernel(
    Q, K, V, O, CU_Q, CU_K, K_DESC1, K_DESC2, V_DESC,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    num_requests, search_steps, qk_scale, window,
    D_QK: tl.constexpr, D_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_DESC: tl.constexpr, WARP_SPEC: tl.constexpr, POS_SCALE: tl.constexpr,
    MASK_ALL: tl.constexpr,  # every key block through the masked path (deterministic mode)
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    head = tl.program_id(1)
    b = find_request(CU_Q, pid, num_requests, search_steps, BLOCK_M)
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    k_start = tl.load(CU_K + b)
    k_len = tl.load(CU_K + b + 1) - k_start
    num_m_blocks = tl.cdiv(q_len, BLOCK_M)
    slot = pid - (q_start // BLOCK_M + b)
    if slot >= num_m_blocks:
        return
    m_blk = num_m_blocks - 1 - slot  # the last query block (most keys) first

    offs_m = tl.arange(0, BLOCK_M)
    rows = m_blk * BLOCK_M + offs_m  # query index within the request
    row_ok = rows < q_len
    pos = k_len - q_len + rows  # each query's key position (end-aligned causality)
    first_pos = k_len - q_len + m_blk * BLOCK_M
    last_pos = k_len - q_len + tl.minimum((m_blk + 1) * BLOCK_M, q_len) - 1

    q_blk = Q + (q_start + m_blk * BLOCK_M).to(tl.int64) * stride_qt + head * stride_qh
    offs_d1 = tl.arange(0, BLOCK_D1)
    q1 = tl.load(q_blk + offs_m[:, None] * stride_qt + offs_d1[None, :], mask=row_ok[:, None], other=0.0)
    if DOT_F32:
        q1 = q1.to(tl.float32)
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
        q2 = tl.load(q_blk + offs_m[:, None] * stride_qt + offs_d2[None, :], mask=row_ok[:, None] & (offs_d2[None, :] < D_QK), other=0.0)
        if DOT_F32:
            q2 = q2.to(tl.float32)
    else:
        q2 = q1  # unused

    k_base = K + k_start.to(tl.int64) * stride_kt + head * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + head * stride_vh

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # A finite start: a row whose first visited block is wholly masked keeps exp2(-inf - m) = 0.
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30

    # Key blocks [full_lo, diag_lo) are visible to every row of the block: no mask.
    diag_lo = (first_pos + 1) // BLOCK_N * BLOCK_N
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), diag_lo)
        acc, l_i, m_i = _attend_blocks(
            acc, l_i, m_i, q1, q2, k_base, v_base, stride_kt, stride_vt, K_DESC1, K_DESC2, V_DESC, k_start, head,
            lo, full_lo, pos, k_len, window, qk_scale,
            True, HAS_WINDOW, USE_DESC, WARP_SPEC, POS_SCALE, D_QK, D_V, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV, DOT_F32, DOT_PRECISION,
        )
    else:
        full_lo = diag_lo * 0
    if MASK_ALL:
        diag_lo = full_lo  # no mask-free blocks: the masked loop below covers [full_lo, last_pos]
    acc, l_i, m_i = _attend_blocks(
        acc, l_i, m_i, q1, q2, k_base, v_base, stride_kt, stride_vt, K_DESC1, K_DESC2, V_DESC, k_start, head,
        full_lo, diag_lo, pos, k_len, window, qk_scale,
        False, HAS_WINDOW, USE_DESC, WARP_SPEC, POS_SCALE, D_QK, D_V, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV, DOT_F32, DOT_PRECISION,
    )
    acc, l_i, m_i = _attend_blocks(
        acc, l_i, m_i, q1, q2, k_base, v_base, stride_kt, stride_vt, K_DESC1, K_DESC2, V_DESC, k_start, head,
        diag_lo, last_pos + 1, pos, k_len, window, qk_scale,
        True, HAS_WINDOW, USE_DESC, WARP_SPEC, POS_SCALE, D_QK, D_V, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV, DOT_F32, DOT_PRECISION,
    )

    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # rows past q_len (never stored) may have seen nothing
    out = acc / l_i[:, None]
    offs_dv = tl.arange(0, BLOCK_DV)
    o_blk = O + (q_start + m_blk * BLOCK_M).to(tl.int64) * stride_ot + head * stride_oh
    o_ptrs = o_blk + offs_m[:, None] * stride_ot + offs_dv[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < D_V))


def _split_head_dim(d: int) -> tuple[int, int]:
    """Dqk as a power-of-two part plus a remainder padded to a power of two (0 when Dqk is one)."""
    d1 = next_power_of_2(d)
    if d1 == d:
        return d, 0
    d1 //= 2
    return d1, max(next_power_of_2(d - d1), 16)


def _descriptors_fit(k: torch.Tensor, v: torch.Tensor) -> bool:
    """TMA descriptors over the [Tk, H * D] views: heads packed, 16-byte aligned base and row stride."""
    for x in (k, v):
        size = x.element_size()
        if x.stride(2) != 1 or x.stride(1) != x.shape[2] or x.data_ptr() % 16 or (x.stride(0) * size) % 16:
            return False
    return True


def _variant(d_qk: int, d_v: int, dtype: torch.dtype) -> str:
    """large_head: Dqk + Dv > 256 (DeepSeek's 192/128); _fp32: 4-byte operands need smaller tiles."""
    name = "large_head" if d_qk + d_v > 256 else "small_head"
    return name + "_fp32" if dtype == torch.float32 else name


def launch_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None,
    *,
    cfg: dict | None = None,
    mask_all: bool = False,
) -> torch.Tensor:
    """The launcher behind `prefill`; `cfg` overrides the tuning table (tests use small blocks);
    mask_all: every key block through the masked path (`prefill_invariant`)."""
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

    c = dict(cfg) if cfg is not None else config("prefill", _variant(d_qk, d_v, q.dtype), q.device)
    block_m, block_n = c["BLOCK_M"], c["BLOCK_N"]
    block_d1, block_d2 = _split_head_dim(d_qk)
    block_dv = max(next_power_of_2(d_v), 16)
    use_desc = bool(c.get("tma", False)) and _descriptors_fit(k, v)
    if use_desc:
        from triton.tools.tensor_descriptor import TensorDescriptor

        def view2d(x: torch.Tensor, block_cols: int) -> TensorDescriptor:
            return TensorDescriptor(x, [x.shape[0], x.shape[1] * x.shape[2]], [x.stride(0), 1], [block_n, block_cols])

        k_desc1, v_desc = view2d(k, block_d1), view2d(v, block_dv)
        k_desc2 = view2d(k, block_d2) if block_d2 else k_desc1
    else:
        k_desc1 = k_desc2 = v_desc = k  # unused placeholders
    grid = (num_tokens // block_m + num_requests, heads)
    _prefill_kernel[grid](
        q, k, v, out, cu_q, cu_k, k_desc1, k_desc2, v_desc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        num_requests, max(num_requests - 1, 0).bit_length(), softmax_scale * LOG2E, sliding_window or 0,
        D_QK=d_qk, D_V=d_v,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D1=block_d1, BLOCK_D2=block_d2, BLOCK_DV=block_dv,
        HAS_WINDOW=sliding_window is not None,
        DOT_F32=upcast_dot(), DOT_PRECISION=dot_precision(q.dtype == torch.float32),
        USE_DESC=use_desc, WARP_SPEC=bool(c.get("warp_specialize", False)), POS_SCALE=softmax_scale > 0, MASK_ALL=mask_all,
        num_warps=c.get("num_warps", 4), num_stages=c.get("num_stages", 2), **pdl_launch(q.device),
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
    return launch_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, sliding_window, mask_all=True)


REGISTRATIONS = [
    Registration(
        op="prefill",
        fn=prefill,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        note="Triton FA2 var-len causal (split Dqk dots, mask-free interior blocks)",
    ),
    Registration(
        op="prefill",
        fn=prefill_invariant,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        priority=-1,
        batch_invariant=True,
        note="Triton FA2 var-len causal, every key block through the masked path (the same arithmetic however the queries were chunked)",
    ),
]

__all__ = ["prefill", "prefill_invariant", "launch_prefill", "REGISTRATIONS"]
