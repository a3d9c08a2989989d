"""Ascend Triton kernels: sparse_attention (DeepSeek-V4's shared-KV multi-query attention over listed
cache rows, with a per-head attention sink).

Every head of a query token attends to the same rows (keys and values are one row), so a block of
BLOCK_H heads of one token is the M side of the cube products and each gathered row block
[BLOCK_N, D] is read once for all of them:

    ids       = indices[t, n0 : n0 + BLOCK_N]                      (-1: no row, masked)
    tile[N,D] = kv[ids]                                            (row gather: one DMA per row)
    scores    = q[t, heads] @ tile^T * scale                       (cube)
    acc      += softmax-weights @ tile                             (cube, the same tile as V)

with the online (log-sum-exp) softmax in float32 on the vector side in between. The window's list
(indices over kv) and the compressed entries' list (extra_indices over extra_kv) run as one
sequence of row blocks through the same running max / sum / accumulator: one softmax. The sink
joins only the final normaliser: with M = max(m, sink),
    out = acc * e^(m - M) / (l * e^(m - M) + e^(sink - M)),
zero for a query that listed no row (acc = l = 0), never a division by zero.

Grid: persistent, `cube_grid(items)` programs (one per AI core); program p runs items p, p + P, ...
Items are (token, split, head block), head block fastest, so the head blocks of one token run at
the same time on neighbouring cores and share the row gathers through L2. Splits: decode has
T = batch, and T * head blocks items may leave AI cores idle; then each token's row blocks (both
lists, window first) are cut into `splits` runs of whole blocks, each item writes its normalised
float32 partial and its log-sum-exp, and a vector kernel (`vector_grid` over (token, 16-head
block) items) merges them in split order with the sink (deterministic, no atomics). The split
count comes from host-known shapes only (T, H, the lists' widths, the AI-core count), never from
the ids: no host synchronisation.

Buffer budget (unified buffer, all live tiles under half of it; D = 512 padded to BLOCK_D):
  resident q: tile BLOCK_N*D*e + q BLOCK_H*D*e + acc BLOCK_H*D*4 + scores BLOCK_H*BLOCK_N*(4 + e).
    bf16, 16 heads: A2/A3 (96 KB) BLOCK_N 32 -> 83 KB; 950 (128 KB) BLOCK_N 64 -> 118 KB.
  D-chunked scores (Q_CHUNK > 0, when nothing else fits: float32 on A2/A3): q is not kept; the
    scores are summed over D chunks of Q_CHUNK columns gathered from q and the rows, then the
    whole tile is gathered for the value product. float32, 16 x 16: 82 KB.
  More heads per block (32, 64) only when they fit: with D = 512 a [32, 512] float32 accumulator
  is 64 KB, so V4's 64 heads run as head blocks of 16 that re-read the rows from L2.
  FP8 caches (PARTS, below): decoded tile BLOCK_N*D*e + the decode of one quarter
    BLOCK_N*(D/4)*13 (its bytes, two int32 temporaries, the float32 values) + q BLOCK_H*D*e + acc
    BLOCK_H*D*4 + scores BLOCK_H*BLOCK_N*(4 + e).
    bf16, 16 heads: A2/A3 and 950 BLOCK_N 16 -> 91.5 KB (BLOCK_N 32 would be 135 KB).
    float32 q: 950 BLOCK_N 16 -> 124 KB; A2/A3: nothing fits half the buffer, the smallest tiles
    (16 x 16, 124 KB) leave no room for double buffering (float32 activations are a test dtype).
The combine kernel holds [16, D] float32 accumulator + partial: 64 KB.

FP8 caches (deepinfer.ops.kv_cache_format: D e4m3 bytes, then the row's float32 scale; kv and
extra_kv each either format): an FP8 cache is passed as its bytes and the same memory as float32
(`fp8_views`; row i's scale at float32 index (i * row stride + D) / 4). Its gathered bytes are
decoded by integer arithmetic (`deepinfer.triton_common.e4m3_bits_to_f32`: A2/A3 have no float8
type) exactly to q's dtype and feed the same cube products; each row's scale multiplies its
column of scores and, after the softmax statistics, of weights (s * (q . v) and (p * s) @ v), so no
tile element is ever scaled. The decode needs about 13 bytes of temporaries per element (a whole
[16, 512] tile: 104 KB on its own), so when either list's cache is FP8 the row blocks are decoded
(and, for a list in the model dtype, loaded) as PARTS = 4 column quarters, each with its own
[BLOCK_H, D/4] accumulator (four named tiles: a Triton tensor cannot be written in parts), and
only one quarter's decode is live at a time.

Deterministic mode (`sparse_attention_invariant`, the batch-invariant registration): the default
split count follows T and the lists' widths (padded to the batch's longest list), and with it the
cut of a token's row blocks and direct vs merged output. The invariant kernel always runs one split
(DIRECT): each token's row blocks are folded in list order (window list, then extra list) by one
program and normalised with the sink there. A wider list adds blocks of -1 ids, whose scores are
-inf: they leave the running max, sum and accumulator exactly as they were (alpha = e^0 = 1,
weights 0), so padding to a neighbour's width changes no bit. A split count of a fixed number of
rows per list would be invariant too, but its partials (T * splits * H * D float32) are far too
large for prefill. Cost on hardware: decode with few tokens keeps T * head blocks AI cores busy
(V4's 64 heads: 4 per token, so a batch of 6 fills a 910B), long lists are one core's work.

With out_positions (V4: the values carried their key's rotation, undone on the output), the step
that writes a query's output rows rotates their last R channels (`triton_common.rotate_tail_pairs`,
on the rows rounded to the output dtype, as the reference's rope reads them): a DIRECT item its
[BLOCK_H, D] tile (with FP8 parts, the parts that hold rope channels), the combine its item's rows.

Index arithmetic is int32; IDX64 switches the row, token and partial offsets to int64 when a
tensor has >= 2^31 elements (a flat cache of 512-wide rows does at 4M rows). Row ids must be < the
cache's rows (the reference raises on larger ids; checking here would need a host
synchronisation): the kernel does not check them.

Deviations (interpreter only): bf16 dot operands are upcast to float32 (community Triton's
interpreter computes bf16 tl.dot wrongly: deepinfer.triton_common.upcast_dot). Outputs are rounded
to nearest even by `common.to_output`.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer.ops import kv_cache_format
from deepinfer.ops import sparse_attention as sparse_ops
from deepinfer.triton_common import (
    cdiv,
    float32_dots,
    fp8_views,
    last_dim_contiguous,
    next_power_of_2,
    normalise_with_sink,
    pick_splits,
    rotate_tail_pairs,
    softmax_block,
    split_partial,
    split_row_blocks,
    upcast_dot,
)
from deepinfer_ascend.kernels.common import (
    Registration,
    add_chunked_scores,
    cube_grid,
    current,
    dot_precision,
    launch_options,
    load_kv_cols,
    load_q_cols,
    to_output,
    vector_grid,
)

INT32_LIMIT = 2**31
MIN_ROWS_PER_SPLIT = 128  # a split's partial write (BLOCK_H * D * 4 bytes) stays small next to its reads
MAX_SPLITS = 32
COMBINE_H = 16
PARTS = 4  # with an FP8 cache, row blocks are decoded (and accumulated) in this many column parts
FP8_DECODE_BYTES = 13  # live bytes per decoded element: the e4m3 byte, two int32 temporaries, the float32 value


@triton.jit
def _attend(
    q_rows, h_ok, m_i, l_i, acc, kv_ptr, idx_row, width, stride_kv, blk_lo, blk_hi, sm_scale,
    arange_n, offs_d, d_ok, q_full,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, Q_CHUNK: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, IDX64: tl.constexpr,
):
    """Fold the row blocks blk_lo .. blk_hi - 1 of one index list into the running (m, l, acc)."""
    for blk in range(blk_lo, blk_hi):
        offs_n = blk * BLOCK_N + arange_n
        ids = tl.load(idx_row + offs_n, mask=offs_n < width, other=-1)
        ok = ids >= 0
        safe = tl.where(ok, ids, 0)
        if IDX64:
            rows = kv_ptr + safe.to(tl.int64) * stride_kv
        else:
            rows = kv_ptr + safe * stride_kv
        if Q_CHUNK == 0:
            tile = tl.load(rows[:, None] + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
            if DOT_F32:
                tile = tile.to(tl.float32)
            scores = tl.dot(q_full, tl.trans(tile), input_precision=DOT_PRECISION)
        else:
            scores = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
            scores = add_chunked_scores(scores, q_rows, h_ok, rows, ok, D, BLOCK_D, Q_CHUNK, DOT_F32, DOT_PRECISION)
            tile = tl.load(rows[:, None] + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
            if DOT_F32:
                tile = tile.to(tl.float32)
        scores = tl.where(ok[None, :], scores * sm_scale, float("-inf"))
        p, alpha, m_new, l_i = softmax_block(scores, m_i, l_i, BASE2=False)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(tile.dtype), tile, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _attend_parts(
    q0, q1, q2, q3, m_i, l_i, acc0, acc1, acc2, acc3, kv_ptr, scale_ptr, idx_row, width, stride_kv, blk_lo, blk_hi, sm_scale,
    arange_n,
    D: tl.constexpr, PART: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, IDX64: tl.constexpr, FP8: tl.constexpr,
):
    """`_attend` with q and the accumulator in PARTS = 4 column parts [.., PART] (taken when a cache
    is FP8): each part of a row block is loaded (decoded) once and feeds both of its products.
    FP8: kv_ptr holds the cache's bytes, scale_ptr the same memory as float32, and each row's scale
    multiplies its scores and its weights."""
    for blk in range(blk_lo, blk_hi):
        offs_n = blk * BLOCK_N + arange_n
        ids = tl.load(idx_row + offs_n, mask=offs_n < width, other=-1)
        ok = ids >= 0
        safe = tl.where(ok, ids, 0)
        if IDX64:
            row_off = safe.to(tl.int64) * stride_kv
        else:
            row_off = safe * stride_kv
        rows = kv_ptr + row_off
        v0 = load_kv_cols(rows, ok, 0 * PART, q0, D, PART, FP8)
        scores = tl.dot(q0, tl.trans(v0), input_precision=DOT_PRECISION)
        v1 = load_kv_cols(rows, ok, 1 * PART, q1, D, PART, FP8)
        scores = tl.dot(q1, tl.trans(v1), scores, input_precision=DOT_PRECISION)
        v2 = load_kv_cols(rows, ok, 2 * PART, q2, D, PART, FP8)
        scores = tl.dot(q2, tl.trans(v2), scores, input_precision=DOT_PRECISION)
        v3 = load_kv_cols(rows, ok, 3 * PART, q3, D, PART, FP8)
        scores = tl.dot(q3, tl.trans(v3), scores, input_precision=DOT_PRECISION)
        if FP8:  # value = e4m3 * the row's scale: it multiplies the row's scores and, below, its weights
            row_scale = tl.load(scale_ptr + (row_off + D) // 4, mask=ok, other=0.0)
            scores = scores * (row_scale * sm_scale)[None, :]
        else:
            scores = scores * sm_scale
        scores = tl.where(ok[None, :], scores, float("-inf"))
        p, alpha, m_new, l_i = softmax_block(scores, m_i, l_i, BASE2=False)
        if FP8:
            p = p * row_scale[None, :]
        p = p.to(v0.dtype)
        acc0 = tl.dot(p, v0, acc0 * alpha[:, None], input_precision=DOT_PRECISION)
        acc1 = tl.dot(p, v1, acc1 * alpha[:, None], input_precision=DOT_PRECISION)
        acc2 = tl.dot(p, v2, acc2 * alpha[:, None], input_precision=DOT_PRECISION)
        acc3 = tl.dot(p, v3, acc3 * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _rotated_out(values, like_ptr, col0, pos, ocs_ptr, stride_ocs, D: tl.constexpr, R: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """float32 output values [ROWS, WIDTH] (columns col0 ...) rounded to like_ptr's type, their channels
    past D - R rotated at pos (the reference rotates the rounded output), in float32."""
    return rotate_tail_pairs(to_output(values, like_ptr).to(tl.float32), col0, pos, ocs_ptr, stride_ocs, D, R, ROWS, WIDTH)


@triton.jit
def _store_part(
    rows, values, h_ok, like_ptr, pos, ocs_ptr, stride_ocs,
    COL0: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, PART: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr,
):
    """One column part [ROWS, PART] into columns COL0 ... of `rows`, rotated first where it holds rope channels."""
    offs = tl.arange(0, PART)
    if ROPE:
        if COL0 + PART > D - R:
            values = _rotated_out(values, like_ptr, COL0, pos, ocs_ptr, stride_ocs, D, R, ROWS, PART)
    tl.store(rows[:, None] + COL0 + offs[None, :], to_output(values, like_ptr), mask=h_ok[:, None] & (COL0 + offs < D)[None, :])


@triton.jit
def _store_parts(
    rows, acc0, acc1, acc2, acc3, factor, h_ok, like_ptr, pos, ocs_ptr, stride_ocs,
    ROWS: tl.constexpr, D: tl.constexpr, PART: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr,
):
    """acc parts * factor[:, None] into columns k * PART ... of `rows`, in like_ptr's element type; with
    ROPE the channels past D - R rotated at pos (in the parts that hold some)."""
    f = factor[:, None]
    _store_part(rows, acc0 * f, h_ok, like_ptr, pos, ocs_ptr, stride_ocs, 0, ROWS, D, PART, ROPE, R)
    _store_part(rows, acc1 * f, h_ok, like_ptr, pos, ocs_ptr, stride_ocs, PART, ROWS, D, PART, ROPE, R)
    _store_part(rows, acc2 * f, h_ok, like_ptr, pos, ocs_ptr, stride_ocs, 2 * PART, ROWS, D, PART, ROPE, R)
    _store_part(rows, acc3 * f, h_ok, like_ptr, pos, ocs_ptr, stride_ocs, 3 * PART, ROWS, D, PART, ROPE, R)


@triton.jit
def _sparse_attention_kernel(
    q_ptr, kv_ptr, kv_scale_ptr, idx_ptr, xkv_ptr, xkv_scale_ptr, xidx_ptr, xlen_ptr, sinks_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, opos_ptr, ocs_ptr,
    sm_scale,
    K, K2,  # widths of the two index lists
    num_items, num_splits,
    stride_q_t, stride_q_h,
    stride_kv, stride_idx_t,
    stride_xkv, stride_xidx_t,
    stride_o_t, stride_o_h,
    stride_po_t, stride_po_split, stride_po_h,
    stride_pl_t, stride_pl_split, stride_ocs,
    H: tl.constexpr, D: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROPE: tl.constexpr, R: tl.constexpr,  # out_positions given: the output's last R channels rotated at them (table ocs_ptr)
    Q_CHUNK: tl.constexpr,  # 0: q resident; else the scores are summed over D chunks of this width (PARTS: the part width)
    HAS_EXTRA: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,  # extra_lengths given: query t reads extra_indices[t, :extra_lengths[t]] only
    DIRECT: tl.constexpr,  # one split: normalise with the sink and write out, no partials
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IDX64: tl.constexpr,
    FP8: tl.constexpr,  # kv is an FP8 cache: kv_ptr its bytes, kv_scale_ptr the same memory as float32
    XFP8: tl.constexpr,  # extra_kv is (xkv_ptr, xkv_scale_ptr)
    PARTS: tl.constexpr,  # q and the accumulator in 4 column parts of Q_CHUNK (set when FP8 or XFP8)
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    arange_h = tl.arange(0, BLOCK_H)
    arange_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    for item in range(pid, num_items, num_programs):
        hb = item % HEAD_BLOCKS
        rest = item // HEAD_BLOCKS
        split = rest % num_splits
        t = rest // num_splits
        if IDX64:
            t = t.to(tl.int64)
        offs_h = hb * BLOCK_H + arange_h
        h_ok = offs_h < H
        q_rows = q_ptr + t * stride_q_t + offs_h * stride_q_h
        # This token's row blocks: the window list's, then the extra list's up to its length; this
        # split takes the split-th run of cdiv(blocks, splits) of them.
        nb1, width2, nb2, lo, hi = split_row_blocks(K, K2, xlen_ptr, t, split, num_splits, BLOCK_N, HAS_LENGTHS)
        if PARTS:
            q0 = load_q_cols(q_rows, h_ok, 0 * Q_CHUNK, D, Q_CHUNK, DOT_F32)
            q1 = load_q_cols(q_rows, h_ok, 1 * Q_CHUNK, D, Q_CHUNK, DOT_F32)
            q2 = load_q_cols(q_rows, h_ok, 2 * Q_CHUNK, D, Q_CHUNK, DOT_F32)
            q3 = load_q_cols(q_rows, h_ok, 3 * Q_CHUNK, D, Q_CHUNK, DOT_F32)
            m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
            acc0 = tl.zeros([BLOCK_H, Q_CHUNK], dtype=tl.float32)
            acc1 = tl.zeros([BLOCK_H, Q_CHUNK], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_H, Q_CHUNK], dtype=tl.float32)
            acc3 = tl.zeros([BLOCK_H, Q_CHUNK], dtype=tl.float32)
            m_i, l_i, acc0, acc1, acc2, acc3 = _attend_parts(
                q0, q1, q2, q3, m_i, l_i, acc0, acc1, acc2, acc3, kv_ptr, kv_scale_ptr, idx_ptr + t * stride_idx_t, K, stride_kv,
                lo, tl.minimum(hi, nb1), sm_scale, arange_n, D, Q_CHUNK, BLOCK_N, DOT_PRECISION, IDX64, FP8,
            )
            if HAS_EXTRA:
                m_i, l_i, acc0, acc1, acc2, acc3 = _attend_parts(
                    q0, q1, q2, q3, m_i, l_i, acc0, acc1, acc2, acc3, xkv_ptr, xkv_scale_ptr, xidx_ptr + t * stride_xidx_t, width2, stride_xkv,
                    tl.maximum(lo - nb1, 0), tl.minimum(hi - nb1, nb2), sm_scale, arange_n, D, Q_CHUNK, BLOCK_N, DOT_PRECISION, IDX64, XFP8,
                )
            if DIRECT:
                sink = tl.load(sinks_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
                top = tl.maximum(m_i, sink)
                top = tl.where(top == float("-inf"), 0.0, top)
                w = tl.exp(m_i - top)
                denom = l_i * w + tl.exp(sink - top)
                o_rows = out_ptr + t * stride_o_t + offs_h * stride_o_h
                pos = tl.load(opos_ptr + t).to(tl.int32)  # (unused without ROPE: opos_ptr then holds T or more ids; tables are far below 2^31 entries)
                _store_parts(o_rows, acc0, acc1, acc2, acc3, w / tl.where(denom > 0.0, denom, 1.0), h_ok, out_ptr, pos, ocs_ptr, stride_ocs,
                             BLOCK_H, D, Q_CHUNK, ROPE, R)
            else:
                has = l_i > 0.0
                l_safe = tl.where(has, l_i, 1.0)
                po_rows = part_out_ptr + t * stride_po_t + split * stride_po_split + offs_h * stride_po_h
                _store_parts(po_rows, acc0, acc1, acc2, acc3, 1.0 / l_safe, h_ok, part_out_ptr, 0, ocs_ptr, stride_ocs, BLOCK_H, D, Q_CHUNK, False, R)
                lse = tl.where(has, m_i + tl.log(l_safe), float("-inf"))
                tl.store(part_lse_ptr + t * stride_pl_t + split * stride_pl_split + offs_h, lse, mask=h_ok)
        else:
            if Q_CHUNK == 0:
                q_full = tl.load(q_rows[:, None] + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
                if DOT_F32:
                    q_full = q_full.to(tl.float32)
            else:
                q_full = 0.0  # (unused)

            m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
            acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
            m_i, l_i, acc = _attend(
                q_rows, h_ok, m_i, l_i, acc, kv_ptr, idx_ptr + t * stride_idx_t, K, stride_kv, lo, tl.minimum(hi, nb1), sm_scale,
                arange_n, offs_d, d_ok, q_full, D, BLOCK_H, BLOCK_N, BLOCK_D, Q_CHUNK, DOT_F32, DOT_PRECISION, IDX64,
            )
            if HAS_EXTRA:
                m_i, l_i, acc = _attend(
                    q_rows, h_ok, m_i, l_i, acc, xkv_ptr, xidx_ptr + t * stride_xidx_t, width2, stride_xkv,
                    tl.maximum(lo - nb1, 0), tl.minimum(hi - nb1, nb2), sm_scale,
                    arange_n, offs_d, d_ok, q_full, D, BLOCK_H, BLOCK_N, BLOCK_D, Q_CHUNK, DOT_F32, DOT_PRECISION, IDX64,
                )

            mask = h_ok[:, None] & d_ok[None, :]
            if DIRECT:
                sink = tl.load(sinks_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
                out = normalise_with_sink(acc, m_i, l_i, sink, BASE2=False)
                if ROPE:
                    out = _rotated_out(out, out_ptr, 0, tl.load(opos_ptr + t).to(tl.int32), ocs_ptr, stride_ocs, D, R, BLOCK_H, BLOCK_D)
                o_rows = out_ptr + t * stride_o_t + offs_h * stride_o_h
                tl.store(o_rows[:, None] + offs_d[None, :], to_output(out, out_ptr), mask=mask)
            else:
                out, lse = split_partial(acc, m_i, l_i, BASE2=False)
                po_rows = part_out_ptr + t * stride_po_t + split * stride_po_split + offs_h * stride_po_h
                tl.store(po_rows[:, None] + offs_d[None, :], out, mask=mask)
                tl.store(part_lse_ptr + t * stride_pl_t + split * stride_pl_split + offs_h, lse, mask=h_ok)


@triton.jit
def _sparse_attention_combine_kernel(
    part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr, opos_ptr, ocs_ptr,
    num_items, num_splits,
    stride_po_t, stride_po_split, stride_po_h,
    stride_pl_t, stride_pl_split,
    stride_o_t, stride_o_h, stride_ocs,
    H: tl.constexpr, D: tl.constexpr,
    ROPE: tl.constexpr, R: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    IDX64: tl.constexpr,
):
    """Items (token, BLOCK_H heads): merge the splits' partials in split order (online, one pass),
    the sink joining the normaliser."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    for item in range(pid, num_items, num_programs):
        hb = item % HEAD_BLOCKS
        t = item // HEAD_BLOCKS
        if IDX64:
            t = t.to(tl.int64)
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        mask = h_ok[:, None] & d_ok[None, :]
        # The sink starts the running normaliser: weight 1 at m = sink, no value.
        m_i = tl.load(sinks_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        lse_rows = part_lse_ptr + t * stride_pl_t + offs_h
        po_rows = part_out_ptr + t * stride_po_t + offs_h * stride_po_h
        for k in range(num_splits):
            lse = tl.load(lse_rows + k * stride_pl_split, mask=h_ok, other=float("-inf"))
            # Every split writes its partial (zeros when it saw no row), so all are finite.
            part = tl.load(po_rows[:, None] + k * stride_po_split + offs_d[None, :], mask=mask, other=0.0)
            m_new = tl.maximum(m_i, lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            w = tl.exp(lse - m_safe)
            acc = acc * alpha[:, None] + w[:, None] * part
            l_i = l_i * alpha + w
            m_i = m_new
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if ROPE:
            out = _rotated_out(out, out_ptr, 0, tl.load(opos_ptr + t).to(tl.int32), ocs_ptr, stride_ocs, D, R, BLOCK_H, BLOCK_D)
        o_rows = out_ptr + t * stride_o_t + offs_h * stride_o_h
        tl.store(o_rows[:, None] + offs_d[None, :], to_output(out, out_ptr), mask=mask)


def _tile_bytes(block_h: int, block_n: int, block_d: int, e_dot: int, q_chunk: int, fp8: bool = False) -> int:
    """On-chip bytes of every live tile of one attention program (see the module docstring)."""
    acc = block_h * block_d * 4
    scores = block_h * block_n * (4 + e_dot)
    if fp8:  # decoded row block + one part's decode + q + acc + scores
        return block_n * block_d * e_dot + block_n * (block_d // PARTS) * FP8_DECODE_BYTES + block_h * block_d * e_dot + acc + scores
    if q_chunk == 0:
        return block_n * block_d * e_dot + block_h * block_d * e_dot + acc + scores
    return block_n * block_d * e_dot + (block_n + block_h) * q_chunk * e_dot + acc + scores


@lru_cache(maxsize=256)
def _tiles(heads: int, block_d: int, e_dot: int, budget: int, fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_N, Q_CHUNK) that fit `budget` bytes: the most heads per block first (fewer
    re-reads of the rows), then the longest row block of at least 32 rows; 16 rows and then
    D-chunked scores only when nothing else fits. fp8 (PARTS): Q_CHUNK is the part width D / 4."""
    heads_options = [h for h in (64, 32, 16) if h <= max(16, next_power_of_2(heads))]
    for chunk in (block_d // PARTS,) if fp8 else (0, min(128, block_d)):
        for candidates in ([(h, n) for h in heads_options for n in (128, 64, 32)], [(h, 16) for h in heads_options]):
            for block_h, block_n in candidates:
                if _tile_bytes(block_h, block_n, block_d, e_dot, chunk, fp8) <= budget:
                    return block_h, block_n, chunk
    return 16, 16, block_d // PARTS if fp8 else min(64, block_d)


def plan(tokens: int, heads: int, dim: int, width: int, extra_width: int, e_dot: int, num_splits: int | None = None, fp8: bool = False) -> dict:
    """Tiles and split count from host-known shapes only (width, extra_width: the lists' K, K2).
    fp8: a list's cache is FP8 (the PARTS layout; byte parts padded to >= 32 bytes)."""
    dev = current()
    block_d = max(PARTS * 32 if fp8 else 16, next_power_of_2(dim))
    block_h, block_n, q_chunk = _tiles(heads, block_d, e_dot, dev.ub_bytes // 2, fp8)
    head_blocks = cdiv(heads, block_h)
    blocks = max(1, cdiv(width, block_n) + cdiv(extra_width, block_n))
    if num_splits is None:
        limit = min(MAX_SPLITS, blocks, max(1, (width + extra_width) // MIN_ROWS_PER_SPLIT))
        num_splits = pick_splits(tokens * head_blocks, dev.num_aicore, limit)
    return {
        "BLOCK_H": block_h, "BLOCK_N": block_n, "Q_CHUNK": q_chunk, "BLOCK_D": block_d,
        "head_blocks": head_blocks, "num_splits": max(1, min(int(num_splits), blocks, MAX_SPLITS)),
        "bytes": _tile_bytes(block_h, block_n, block_d, e_dot, q_chunk, fp8),
    }


def launch_sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    softmax_scale: float,
    extra_kv: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lengths: torch.Tensor | None = None,
    out_positions: torch.Tensor | None = None,
    out_cos_sin_cache: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """sparse_attention with an optional forced split count (tests use it to exercise the combine)."""
    sparse_ops.check_sparse_attention_shapes(q, kv, indices, sinks, extra_kv, extra_indices, extra_lengths, out_positions, out_cos_sin_cache)
    tokens, heads, dim = q.shape
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    if tokens == 0 or heads == 0 or dim == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    if sinks.stride(-1) != 1:
        sinks = sinks.contiguous()
    has_extra = extra_kv is not None
    if has_extra:
        if extra_kv.stride(-1) != 1:
            extra_kv = extra_kv.contiguous()
        if extra_indices.stride(-1) != 1:
            extra_indices = extra_indices.contiguous()
        xkv, xidx, width2 = extra_kv, extra_indices, extra_indices.shape[1]
    else:
        xkv, xidx, width2 = kv, indices, 0  # unused placeholders
    has_lengths = has_extra and extra_lengths is not None
    xlen = extra_lengths.contiguous() if has_lengths else indices  # (unused without lengths)
    rope = out_positions is not None
    opos = out_positions.contiguous() if rope else indices  # (unused without the rotation)
    ocs = last_dim_contiguous(out_cos_sin_cache)[0] if rope else sinks
    rope_dim = ocs.shape[-1] if rope else 0
    fp8, xfp8 = kv_cache_format.is_fp8(kv), has_extra and kv_cache_format.is_fp8(xkv)
    dot_f32 = float32_dots(q, ((kv, fp8), (xkv, xfp8)) if has_extra else ((kv, fp8),))  # not the placeholder (it would put FP8 sliding layers on float32)
    kv, kv_scales = fp8_views(kv) if fp8 else (kv, kv)  # (the scale views are unused without FP8)
    xkv, xkv_scales = fp8_views(xkv) if xfp8 else (xkv, xkv)
    e_dot = 4 if dot_f32 else q.element_size()
    cfg = plan(tokens, heads, dim, indices.shape[1], width2, e_dot, num_splits, fp8 or xfp8)
    splits = cfg["num_splits"]
    direct = splits == 1
    if direct:
        part_out = part_lse = out  # unused
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    else:
        part_out = torch.empty(tokens, splits, heads, dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(tokens, splits, heads, dtype=torch.float32, device=q.device)
        po_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
        pl_strides = (part_lse.stride(0), part_lse.stride(1))
    # (+ a row stride: offsets are formed before the mask drops them)
    idx64 = max(t.numel() + t.stride(0) for t in (q, kv, xkv, indices, xidx, out, part_out)) >= INT32_LIMIT
    items = tokens * splits * cfg["head_blocks"]
    _sparse_attention_kernel[(cube_grid(items),)](
        q, kv, kv_scales, indices, xkv, xkv_scales, xidx, xlen, sinks,
        out, part_out, part_lse, opos, ocs,
        float(softmax_scale),
        indices.shape[1], width2,
        items, splits,
        q.stride(0), q.stride(1),
        kv.stride(0), indices.stride(0),
        xkv.stride(0), xidx.stride(0),
        out.stride(0), out.stride(1),
        *po_strides,
        *pl_strides, ocs.stride(0),
        H=heads, D=dim,
        HEAD_BLOCKS=cfg["head_blocks"],
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"],
        ROPE=rope, R=rope_dim,
        Q_CHUNK=cfg["Q_CHUNK"],
        HAS_EXTRA=has_extra,
        HAS_LENGTHS=has_lengths,
        DIRECT=direct,
        DOT_F32=dot_f32 or upcast_dot(),
        DOT_PRECISION=dot_precision(dot_f32 or upcast_dot()),
        IDX64=idx64,
        FP8=fp8, XFP8=xfp8, PARTS=fp8 or xfp8,
        **launch_options(),
    )
    if not direct:
        combine_h = min(COMBINE_H, next_power_of_2(heads))
        head_blocks = cdiv(heads, combine_h)
        combine_items = tokens * head_blocks
        _sparse_attention_combine_kernel[(vector_grid(combine_items),)](
            part_out, part_lse, sinks, out, opos, ocs,
            combine_items, splits,
            *po_strides,
            *pl_strides,
            out.stride(0), out.stride(1), ocs.stride(0),
            H=heads, D=dim,
            ROPE=rope, R=rope_dim,
            HEAD_BLOCKS=head_blocks,
            BLOCK_H=combine_h, BLOCK_D=cfg["BLOCK_D"],
            IDX64=idx64,
            **launch_options(),
        )
    return out


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    *,
    softmax_scale: float,
    extra_kv: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lengths: torch.Tensor | None = None,
    out_positions: torch.Tensor | None = None,
    out_cos_sin_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    return launch_sparse_attention(q, kv, indices, sinks, softmax_scale, extra_kv, extra_indices, extra_lengths, out_positions, out_cos_sin_cache)


def sparse_attention_invariant(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    *,
    softmax_scale: float,
    extra_kv: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lengths: torch.Tensor | None = None,
    out_positions: torch.Tensor | None = None,
    out_cos_sin_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    return launch_sparse_attention(
        q, kv, indices, sinks, softmax_scale, extra_kv, extra_indices, extra_lengths, out_positions, out_cos_sin_cache, num_splits=1
    )


REGISTRATIONS = [
    Registration(
        op="sparse_attention",
        fn=sparse_attention,
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        note="Triton (ascend) heads as M over gathered row blocks, persistent cube grid over (token, split, head block), deterministic combine; "
        "FP8 caches decoded in four column parts (integer e4m3), row scales on scores and weights",
    ),
    Registration(
        op="sparse_attention",
        fn=sparse_attention_invariant,
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        priority=-1,
        batch_invariant=True,
        note="Triton (ascend) the kernel above with one split for every call: each token's row blocks in list order, sink in the final normaliser",
    ),
]
