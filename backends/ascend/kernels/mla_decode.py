"""Ascend Triton kernels: mla_decode (absorbed multi-head latent attention over the paged latent cache).

The S*H query rows of a request (S query tokens for MTP times H heads) share one latent KV head, so
they are the M side of the cube products, and every cache tile [BLOCK_N, C + R] is read once for a
whole block of BLOCK_H rows:

    scores[M, N] = q_nope[M, C] @ c[N, C]^T + q_rope[M, R] @ k[N, R]^T      (cube)
    acc[M, C]   += softmax-weights[M, N] @ c[N, C]                           (cube, the same tile as V)

with the online (log-sum-exp) softmax in float32 on the vector side in between.

Grid: persistent, `cube_grid(items)` programs (one per AI core); program p runs work items p, p + P,
... Items are (request, kv split, head block), head block fastest. The split count comes from host-known
shapes only (B, the head blocks, the block table's width, the AI-core count), never from seq_lens:
no host synchronisation. Inside the kernel each request's visible key range [lo, seq_len) (lo: the
window's first tile) is cut into NUM_SPLITS equal runs of whole tiles, so splits balance per request
whatever its length; a split with no tiles reports lse = -inf. One split: the kernel writes the
normalised output directly. Several: it writes normalised float32 partials and their log-sum-exp,
and a vector kernel on `vector_grid` programs merges them in a fixed order (no atomics):
  serial combine: items (request, 16-row block), each reading every split's [16, C] partial in split
    order. Large batches, fewer than WIDE_MIN_SPLITS splits, and always in deterministic mode.
  wide combine: where the serial items would be fewer than the vector cores (small batches, long
    contexts: many splits each; B1 with 16 heads is ONE item, so one vector core would merge
    everything), items (request, query row, WIDE_COLS latent columns), each loading the splits'
    [CHUNK, WIDE_COLS] partials CHUNK (<= WIDE_SPLITS) splits at a time and summing them as a tree
    within each chunk, chunk after chunk: the same bits for a given split count. The choice (`plan`)
    follows the batch, the row blocks, the split count and the vector-core count, never seq_lens.

Tiles: BLOCK_N <= block_size (both powers of two), so a tile never crosses a page: one scalar load
of the page number, then BLOCK_N consecutive rows (one contiguous DMA of BLOCK_N * (C + R) values).
Every paged block size that is a power of two >= 16 works. C and R are padded to powers of two
(masked), so any multiples of 16 work.

Buffer budget (unified buffer, keep all live tiles under half of it; bytes for C=512, R=64):
  resident q: kv tile BLOCK_N*(C+R)*e + q BLOCK_H*(C+R)*e + acc BLOCK_H*C*4 + scores BLOCK_H*BLOCK_N*4
              + p BLOCK_H*BLOCK_N*e.
    bf16, 16 rows: A2/A3 (96 KB) BLOCK_N 32 -> 89 KB; 950 (128 KB) BLOCK_N 64 -> 128 KB.
    float32, 16 rows: 950 BLOCK_N 16 -> 106 KB; A2/A3: nothing fits -> C-chunked scores.
  C-chunked scores (Q_CHUNK > 0): q is not kept; the scores are summed over C chunks of Q_CHUNK
    columns loaded from q and the cache tile, then the latent tile [BLOCK_N, C] is loaded for the
    value product: latent tile + chunk tiles + acc + scores. float32 on A2/A3: BLOCK_N 16 -> 90 KB.
  More rows (S*H > 16) take BLOCK_H 32/64 only when it fits: with C=512 the [BLOCK_H, 512] float32
    accumulator alone is 64 KB at 32 rows, so it never does, and S*H rows run as head blocks of 16.
    Head blocks are the fastest-varying item index, so the head blocks of one (request, split) run
    at the same time on neighbouring cores and share the cache tiles through L2.
  FP8 cache (FP8_PARTS quarters, below): converted tile BLOCK_N*(C+R)*e + the decode of one
    quarter BLOCK_N*(C/4)*13 (its bytes, two int32 temporaries, the float32 values) + q
    BLOCK_H*(C+R)*e + acc BLOCK_H*C*4 + scores BLOCK_H*BLOCK_N*(4+e).
    bf16, 16 rows: A2/A3 and 950 BLOCK_N 16 -> 95.5 KB (BLOCK_N 32 would be 141 KB).
    float32 q: nothing fits half the buffer of either chip; the smallest tiles (16 x 16, 132 KB)
    leave no room for double buffering (float32 activations are a test dtype).
The serial combine holds [16, C] float32 accumulator + partial: 64 KB; the wide one a [32, 64]
float32 partial tile and its weighted copy + a [64] accumulator: 16.3 KB.

FP8 cache (deepinfer.ops.kv_cache_format: rows of C + R e4m3 bytes, then the token's float32
scale): the kernel takes the cache's bytes and the same memory as float32 (`fp8_views`; a row at
byte offset o has its scale at float32 index (o + C + R) / 4). The bytes are decoded by integer
arithmetic (`deepinfer.triton_common.e4m3_bits_to_f32`: A2/A3 have no float8 type) to q's dtype,
exactly, and feed the same cube products; each row's scale multiplies its column of scores and,
after the softmax statistics, of weights (s * (q . v) and (p * s) @ v), so no tile element is ever
scaled. The decode needs about 13 bytes of temporaries per element, so a whole [16, 576] tile
would take 117 KB on its own: the latent columns are decoded as FP8_PARTS = 4 quarters, each with
its own [BLOCK_H, C/4] accumulator (four named tiles: a Triton tensor cannot be written in
parts), and only one quarter's decode is live at a time. The 592-byte rows about halve the DMA of a
bf16 cache; the tiles are smaller (BLOCK_N 16) because of the decode, not the bytes.

Index arithmetic is int32 (page * page stride stays int32 unless the cache tensor has >= 2^31
elements, then IDX64 switches the row offsets to int64).

Deterministic mode (`mla_decode_invariant`, the batch-invariant registration): the default split
count follows the batch size and the block table's width (the batch's longest request), so a
request's key range is cut differently, and merged directly or by the combine, depending on its
neighbours. The invariant plan launches NUM = min(MAX_SPLITS, cdiv(AI cores, head blocks)) splits
(the chip and the model's heads only: one request alone fills the AI cores), and each request cuts
its own visible range [lo, seq_len) into runs of max(cdiv(tiles, NUM), 256 tokens) whole tiles: the
cut depends on the request's own length only. A split past the request's range loads and stores
nothing (its lse stays the -inf the launcher filled in, and the combine reads no partial for it),
so short requests cost no extra traffic; the partials are merged by the serial combine in split
order, in which empty splits add exact zeros. Never by the wide combine: the choice between the two
follows the batch (a request's sums would change order with its neighbours), and it reads every
split's partial. One split per call (DIRECT) only where NUM is 1 for the chip and the model. Cost
on hardware: a partial write and the combine for every request (the default skips both for large
batches), the partial buffer batch * NUM * rows * C * 4 bytes (<= 786 KB a request on a 910B), no
more than NUM-way parallelism for a long request in a large batch (the default would use fewer
splits there anyway), and a serial merge of NUM splits on one vector core per 16 rows.

Deviations (interpreter only): bf16 dot operands are upcast to float32 (community Triton's
interpreter computes bf16 tl.dot wrongly: deepinfer.triton_common.upcast_dot); bf16 outputs are
rounded to nearest even by bit arithmetic (the interpreter truncates float32 -> bfloat16 casts).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer.ops import attention as attention_ops
from deepinfer.ops import kv_cache_format
from deepinfer.triton_common import (
    cdiv,
    fp8_views,
    interpreting,
    merge_split_columns,
    next_power_of_2,
    pick_splits,
    softmax_block,
    split_partial,
    to_bf16_rne,
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
    vector_grid,
)

INT32_LIMIT = 2**31
MIN_TOKENS_PER_SPLIT = 256  # a split's partial write (rows * C * 4 bytes) stays small next to its reads
MAX_SPLITS = 64
COMBINE_ROWS = 16
WIDE_MIN_SPLITS = 8  # fewer splits: the serial combine's merge is short anyway
WIDE_SPLITS = 32  # splits a wide-combine item loads at once (at most)
WIDE_COLS = 64  # latent columns per wide-combine item
# Deterministic mode: a split of a request holds at least this many of its keys (a multiple of every BLOCK_N).
INVARIANT_MIN_SPLIT_TOKENS = 256
FP8_PARTS = 4  # an FP8 cache's latent columns are decoded (and accumulated) in this many parts
FP8_DECODE_BYTES = 13  # live bytes per decoded element: the e4m3 byte, two int32 temporaries, the float32 value


@triton.jit
def _store_rows(ptrs, values, mask, MANUAL_RNE: tl.constexpr):
    if MANUAL_RNE:
        tl.store(ptrs, to_bf16_rne(values), mask=mask)
    else:
        tl.store(ptrs, values.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _attend_fp8(
    q_rows_n, q_rows_r, row_ok, pos, start, end, kv_ptr, scale_ptr, bt_row, sm_scale, window,
    stride_kv_page, stride_kv_row,
    C: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PART: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, IDX64: tl.constexpr,
):
    """One item's keys start .. end - 1 over an FP8 cache: (m, l, and the four accumulator parts
    [BLOCK_H, PART], latent columns k * PART ...). Each part is decoded once per tile and feeds both
    of its products; each row's scale multiplies its scores and its weights."""
    qr = load_q_cols(q_rows_r, row_ok, 0, R, BLOCK_R, DOT_F32)
    q0 = load_q_cols(q_rows_n, row_ok, 0 * PART, C, PART, DOT_F32)
    q1 = load_q_cols(q_rows_n, row_ok, 1 * PART, C, PART, DOT_F32)
    q2 = load_q_cols(q_rows_n, row_ok, 2 * PART, C, PART, DOT_F32)
    q3 = load_q_cols(q_rows_n, row_ok, 3 * PART, C, PART, DOT_F32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, PART], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, PART], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, PART], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, PART], dtype=tl.float32)
    arange_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        page = tl.load(bt_row + start_n // PAGE)
        if IDX64:
            row0 = page.to(tl.int64) * stride_kv_page + (start_n % PAGE) * stride_kv_row
        else:
            row0 = page * stride_kv_page + (start_n % PAGE) * stride_kv_row
        row_off = row0 + arange_n * stride_kv_row
        kv_rows = kv_ptr + row_off
        offs_n = start_n + arange_n
        n_ok = offs_n < end
        kr = load_kv_cols(kv_rows + C, n_ok, 0, qr, R, BLOCK_R, True)
        scores = tl.dot(qr, tl.trans(kr), input_precision=DOT_PRECISION)
        v0 = load_kv_cols(kv_rows, n_ok, 0 * PART, q0, C, PART, True)
        scores = tl.dot(q0, tl.trans(v0), scores, input_precision=DOT_PRECISION)
        v1 = load_kv_cols(kv_rows, n_ok, 1 * PART, q1, C, PART, True)
        scores = tl.dot(q1, tl.trans(v1), scores, input_precision=DOT_PRECISION)
        v2 = load_kv_cols(kv_rows, n_ok, 2 * PART, q2, C, PART, True)
        scores = tl.dot(q2, tl.trans(v2), scores, input_precision=DOT_PRECISION)
        v3 = load_kv_cols(kv_rows, n_ok, 3 * PART, q3, C, PART, True)
        scores = tl.dot(q3, tl.trans(v3), scores, input_precision=DOT_PRECISION)
        # value = e4m3 * the row's scale: the scale multiplies a key's scores and, below, its weights.
        row_scale = tl.load(scale_ptr + (row_off + C + R) // 4, mask=n_ok, other=0.0)
        scores = scores * (row_scale * sm_scale)[None, :]
        visible = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))

        p, alpha, m_new, l_i = softmax_block(scores, m_i, l_i, BASE2=False)
        p = (p * row_scale[None, :]).to(v0.dtype)
        acc0 = tl.dot(p, v0, acc0 * alpha[:, None], input_precision=DOT_PRECISION)
        acc1 = tl.dot(p, v1, acc1 * alpha[:, None], input_precision=DOT_PRECISION)
        acc2 = tl.dot(p, v2, acc2 * alpha[:, None], input_precision=DOT_PRECISION)
        acc3 = tl.dot(p, v3, acc3 * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _store_parts(rows, acc0, acc1, acc2, acc3, l_safe, row_ok, C: tl.constexpr, PART: tl.constexpr, MANUAL_RNE: tl.constexpr):
    """The normalised accumulator parts of `_attend_fp8` into columns k * PART ... of `rows`."""
    offs = tl.arange(0, PART)
    _store_rows(rows[:, None] + offs[None, :], acc0 / l_safe[:, None], row_ok[:, None] & (offs < C)[None, :], MANUAL_RNE)
    _store_rows(rows[:, None] + PART + offs[None, :], acc1 / l_safe[:, None], row_ok[:, None] & (PART + offs < C)[None, :], MANUAL_RNE)
    _store_rows(rows[:, None] + 2 * PART + offs[None, :], acc2 / l_safe[:, None], row_ok[:, None] & (2 * PART + offs < C)[None, :], MANUAL_RNE)
    _store_rows(rows[:, None] + 3 * PART + offs[None, :], acc3 / l_safe[:, None], row_ok[:, None] & (3 * PART + offs < C)[None, :], MANUAL_RNE)


@triton.jit
def _decode_item(
    q_nope_ptr, q_rope_ptr, kv_ptr, scale_ptr, block_table_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    sm_scale, window, b, split, offs_m, row_ok, pos, start, end,
    stride_qn_b, stride_qn_m, stride_qr_b, stride_qr_m, stride_kv_page, stride_kv_row, stride_bt_b,
    stride_o_b, stride_o_m, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
    C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, Q_CHUNK: tl.constexpr, HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, IDX64: tl.constexpr, MANUAL_RNE: tl.constexpr, FP8: tl.constexpr,
):
    """One work item of the split kernel: request b's rows offs_m (row_ok) over its keys start .. end - 1
    (split `split`): the normalised output (DIRECT) or the float32 partial and its log-sum-exp."""
    arange_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    c_ok = offs_c < C
    r_ok = offs_r < R
    q_rows_n = q_nope_ptr + b * stride_qn_b + offs_m * stride_qn_m
    q_rows_r = q_rope_ptr + b * stride_qr_b + offs_m * stride_qr_m
    if FP8:
        m_i, l_i, acc0, acc1, acc2, acc3 = _attend_fp8(
            q_rows_n, q_rows_r, row_ok, pos, start, end, kv_ptr, scale_ptr, block_table_ptr + b * stride_bt_b, sm_scale, window,
            stride_kv_page, stride_kv_row, C, R, BLOCK_R, PAGE, BLOCK_H, BLOCK_N, Q_CHUNK,
            HAS_WINDOW, DOT_F32, DOT_PRECISION, IDX64,
        )
        has = l_i > 0.0
        l_safe = tl.where(has, l_i, 1.0)
        if DIRECT:
            o_rows = out_ptr + b * stride_o_b + offs_m * stride_o_m
            _store_parts(o_rows, acc0, acc1, acc2, acc3, l_safe, row_ok, C, Q_CHUNK, MANUAL_RNE)
        else:
            po_rows = part_out_ptr + b * stride_po_b + split * stride_po_split + offs_m * stride_po_m
            _store_parts(po_rows, acc0, acc1, acc2, acc3, l_safe, row_ok, C, Q_CHUNK, False)
            lse = tl.where(has, m_i + tl.log(l_safe), float("-inf"))
            tl.store(part_lse_ptr + b * stride_pl_b + split * stride_pl_split + offs_m, lse, mask=row_ok)
    else:
        qr = tl.load(q_rows_r[:, None] + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        if DOT_F32:
            qr = qr.to(tl.float32)
        if Q_CHUNK == 0:
            qn = tl.load(q_rows_n[:, None] + offs_c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
            if DOT_F32:
                qn = qn.to(tl.float32)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
        bt_row = block_table_ptr + b * stride_bt_b
        for start_n in range(start, end, BLOCK_N):
            # The tile lies inside one page (BLOCK_N divides PAGE): one page number, consecutive rows.
            page = tl.load(bt_row + start_n // PAGE)
            if IDX64:
                row0 = page.to(tl.int64) * stride_kv_page + (start_n % PAGE) * stride_kv_row
            else:
                row0 = page * stride_kv_page + (start_n % PAGE) * stride_kv_row
            kv_rows = kv_ptr + row0 + arange_n * stride_kv_row
            offs_n = start_n + arange_n
            n_ok = offs_n < end
            kr = tl.load(kv_rows[:, None] + C + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
            if DOT_F32:
                kr = kr.to(tl.float32)
            scores = tl.dot(qr, tl.trans(kr), input_precision=DOT_PRECISION)
            if Q_CHUNK == 0:
                kc = tl.load(kv_rows[:, None] + offs_c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
                if DOT_F32:
                    kc = kc.to(tl.float32)
                scores = tl.dot(qn, tl.trans(kc), scores, input_precision=DOT_PRECISION)
            else:
                scores = add_chunked_scores(scores, q_rows_n, row_ok, kv_rows, n_ok, C, BLOCK_C, Q_CHUNK, DOT_F32, DOT_PRECISION)
                kc = tl.load(kv_rows[:, None] + offs_c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
                if DOT_F32:
                    kc = kc.to(tl.float32)
            scores = scores * sm_scale
            visible = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
            if HAS_WINDOW:
                visible = visible & (offs_n[None, :] > pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))

            p, alpha, m_new, l_i = softmax_block(scores, m_i, l_i, BASE2=False)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(kc.dtype), kc, acc, input_precision=DOT_PRECISION)
            m_i = m_new

        out, lse = split_partial(acc, m_i, l_i, BASE2=False)
        out_mask = row_ok[:, None] & c_ok[None, :]
        if DIRECT:
            o_rows = out_ptr + b * stride_o_b + offs_m * stride_o_m
            _store_rows(o_rows[:, None] + offs_c[None, :], out, out_mask, MANUAL_RNE)
        else:
            po_rows = part_out_ptr + b * stride_po_b + split * stride_po_split + offs_m * stride_po_m
            tl.store(po_rows[:, None] + offs_c[None, :], out, mask=out_mask)
            tl.store(part_lse_ptr + b * stride_pl_b + split * stride_pl_split + offs_m, lse, mask=row_ok)


@triton.jit
def _mla_decode_split_kernel(
    q_nope_ptr, q_rope_ptr, kv_ptr, scale_ptr, block_table_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    sm_scale,
    window,  # sliding window (used only when HAS_WINDOW)
    num_items, num_head_blocks, num_splits,
    stride_qn_b, stride_qn_m,
    stride_qr_b, stride_qr_m,
    stride_kv_page, stride_kv_row,
    stride_bt_b,
    stride_o_b, stride_o_m,
    stride_po_b, stride_po_split, stride_po_m,
    stride_pl_b, stride_pl_split,
    S: tl.constexpr, H: tl.constexpr,
    C: tl.constexpr, R: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    Q_CHUNK: tl.constexpr,  # 0: q resident; else the scores are summed over C chunks of this width (FP8: the part width, BLOCK_C / 4)
    HAS_WINDOW: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the final output, no partials
    DOT_F32: tl.constexpr,  # dot operands in float32 (float32 / mixed inputs, or the interpreter)
    DOT_PRECISION: tl.constexpr,
    IDX64: tl.constexpr,
    MANUAL_RNE: tl.constexpr,
    FP8: tl.constexpr,  # an FP8 cache: kv_ptr its bytes, scale_ptr the same memory as float32
    MIN_SPLIT_TILES: tl.constexpr = 0,  # deterministic mode: a split holds at least this many tiles; an empty split does nothing
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    arange_m = tl.arange(0, BLOCK_H)
    for item in range(pid, num_items, num_programs):
        hb = item % num_head_blocks
        rest = item // num_head_blocks
        split = rest % num_splits
        b = rest // num_splits

        offs_m = hb * BLOCK_H + arange_m
        row_ok = offs_m < S * H
        s_idx = offs_m // H
        seq_len = tl.load(seq_lens_ptr + b)
        # Query row m sits at position seq_len - S + s and sees keys j <= pos (and j > pos - window).
        pos = seq_len - S + s_idx
        if HAS_WINDOW:
            # The first query (s = 0) sees the earliest keys; tiles wholly before them are skipped.
            lo = tl.maximum(seq_len - S - window + 1, 0) // BLOCK_N * BLOCK_N
        else:
            lo = seq_len * 0
        per_split = tl.cdiv(tl.cdiv(seq_len - lo, BLOCK_N), num_splits) * BLOCK_N
        if MIN_SPLIT_TILES > 0:
            per_split = tl.maximum(per_split, MIN_SPLIT_TILES * BLOCK_N)
        start = lo + split * per_split
        end = tl.minimum(start + per_split, seq_len)

        if MIN_SPLIT_TILES > 0 and not DIRECT:
            if start < end:  # an empty split does nothing: its lse stays the -inf the launcher filled in
                _decode_item(
                    q_nope_ptr, q_rope_ptr, kv_ptr, scale_ptr, block_table_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                    sm_scale, window, b, split, offs_m, row_ok, pos, start, end,
                    stride_qn_b, stride_qn_m, stride_qr_b, stride_qr_m, stride_kv_page, stride_kv_row, stride_bt_b,
                    stride_o_b, stride_o_m, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
                    C, R, BLOCK_C, BLOCK_R, PAGE, BLOCK_H, BLOCK_N, Q_CHUNK, HAS_WINDOW, DIRECT, DOT_F32, DOT_PRECISION, IDX64, MANUAL_RNE, FP8,
                )
        else:
            _decode_item(
                q_nope_ptr, q_rope_ptr, kv_ptr, scale_ptr, block_table_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                sm_scale, window, b, split, offs_m, row_ok, pos, start, end,
                stride_qn_b, stride_qn_m, stride_qr_b, stride_qr_m, stride_kv_page, stride_kv_row, stride_bt_b,
                stride_o_b, stride_o_m, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
                C, R, BLOCK_C, BLOCK_R, PAGE, BLOCK_H, BLOCK_N, Q_CHUNK, HAS_WINDOW, DIRECT, DOT_F32, DOT_PRECISION, IDX64, MANUAL_RNE, FP8,
            )


@triton.jit
def _mla_decode_combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    num_items, num_row_blocks, num_splits,
    stride_po_b, stride_po_split, stride_po_m,
    stride_pl_b, stride_pl_split,
    stride_o_b, stride_o_m,
    ROWS: tl.constexpr, C: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    MANUAL_RNE: tl.constexpr,
    SKIP_EMPTY: tl.constexpr = False,  # deterministic mode: a split with lse -inf wrote no partial
):
    """Items (request, row block): merge the splits' normalised partials in split order."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    for item in range(pid, num_items, num_programs):
        b = item // num_row_blocks
        offs_m = (item % num_row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < ROWS
        mask = row_ok[:, None] & c_ok[None, :]
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
        lse_rows = part_lse_ptr + b * stride_pl_b + offs_m
        po_rows = part_out_ptr + b * stride_po_b + offs_m * stride_po_m
        for k in range(num_splits):
            lse = tl.load(lse_rows + k * stride_pl_split, mask=row_ok, other=float("-inf"))
            if SKIP_EMPTY:  # (the weight of such a split is 0: its partial is read as zeros)
                part = tl.load(po_rows[:, None] + k * stride_po_split + offs_c[None, :], mask=mask & (lse > float("-inf"))[:, None], other=0.0)
            else:
                # Every split writes its partial (zeros when it saw no key), so all are finite.
                part = tl.load(po_rows[:, None] + k * stride_po_split + offs_c[None, :], mask=mask, other=0.0)
            m_new = tl.maximum(m_i, lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            w = tl.exp(lse - m_safe)
            acc = acc * alpha[:, None] + w[:, None] * part
            l_i = l_i * alpha + w
            m_i = m_new
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_rows = out_ptr + b * stride_o_b + offs_m * stride_o_m
        _store_rows(o_rows[:, None] + offs_c[None, :], out, mask, MANUAL_RNE)


@triton.jit
def _mla_decode_wide_combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    num_items, num_rows, num_col_blocks, num_splits,
    stride_po_b, stride_po_split, stride_po_m,
    stride_pl_b, stride_pl_split,
    stride_o_b, stride_o_m,
    C: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CC: tl.constexpr,
    MANUAL_RNE: tl.constexpr,
):
    """Items (request, query row, BLOCK_CC latent columns): every split's partial of those columns,
    CHUNK splits a load (one [CHUNK, BLOCK_CC] tile instead of one split after another), summed as a
    tree within each chunk. Every split must have written its partial (the default mode's kernel)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    arange_c = tl.arange(0, BLOCK_CC)
    for item in range(pid, num_items, num_programs):
        # Column blocks fastest: neighbouring cores read neighbouring columns of the same rows.
        col_block = item % num_col_blocks
        rest = item // num_col_blocks
        m = rest % num_rows
        b = rest // num_rows
        offs_c = col_block * BLOCK_CC + arange_c
        c_ok = offs_c < C
        out = merge_split_columns(
            part_lse_ptr + b * stride_pl_b + m, part_out_ptr + b * stride_po_b + m * stride_po_m, stride_pl_split, stride_po_split,
            num_splits, offs_c, c_ok, CHUNK, BASE2=False,
        )
        _store_rows(out_ptr + b * stride_o_b + m * stride_o_m + offs_c, out, c_ok, MANUAL_RNE)


def _tile_bytes(block_h: int, block_n: int, block_c: int, block_r: int, e_dot: int, q_chunk: int, fp8: bool = False) -> int:
    """On-chip bytes of every live tile of one split-kernel program (see the module docstring)."""
    acc = block_h * block_c * 4
    scores = block_h * block_n * 4 + block_h * block_n * e_dot
    if fp8:  # decoded tile + one part's decode + q + acc + scores
        decode = block_n * max(block_c // FP8_PARTS, block_r) * FP8_DECODE_BYTES
        return block_n * (block_c + block_r) * e_dot + decode + block_h * (block_c + block_r) * e_dot + acc + scores
    if q_chunk == 0:
        return block_n * (block_c + block_r) * e_dot + block_h * (block_c + block_r) * e_dot + acc + scores
    return block_n * block_c * e_dot + block_n * (q_chunk + block_r) * e_dot + block_h * (q_chunk + block_r) * e_dot + acc + scores


@lru_cache(maxsize=256)
def _tiles(rows: int, page: int, block_c: int, block_r: int, e_dot: int, budget: int, fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_N, Q_CHUNK) that fit `budget` bytes: the most rows per tile first (fewer
    re-reads of the cache), then the longest tile of at least 32 tokens; BLOCK_N 16 and then
    C-chunked scores only when nothing else fits. FP8: Q_CHUNK is the part width (BLOCK_C / 4)."""
    heads = [h for h in (64, 32, 16) if h <= max(16, next_power_of_2(rows))]
    lengths = [n for n in (128, 64, 32) if n <= page]
    for chunk in (block_c // FP8_PARTS,) if fp8 else (0, min(128, block_c)):
        for candidates in ([(h, n) for h in heads for n in lengths], [(h, 16) for h in heads]):
            for block_h, block_n in candidates:
                if _tile_bytes(block_h, block_n, block_c, block_r, e_dot, chunk, fp8) <= budget:
                    return block_h, block_n, chunk
    return 16, 16, block_c // FP8_PARTS if fp8 else min(64, block_c)


def plan(
    batch: int, rows: int, page: int, capacity: int, latent_dim: int, rope_dim: int, e_dot: int,
    num_splits: int | None = None, tiles: dict | None = None, fp8: bool = False, invariant: bool = False,
) -> dict:
    """Tiles and split count from host-known shapes only (capacity = block-table width * page).
    fp8: an FP8 cache (e_dot is q's dot dtype); its byte rows are padded to >= 32 bytes per part.
    invariant (deterministic mode): the split count from the chip and the head blocks only, and
    splits of at least INVARIANT_MIN_SPLIT_TOKENS (`MIN_SPLIT_TILES`): see the module docstring.
    wide_combine: the partials are merged by the wide combine (fewer serial-combine items than
    vector cores, at least WIDE_MIN_SPLITS splits; never in deterministic mode)."""
    dev = current()
    block_c = max(FP8_PARTS * 32 if fp8 else 16, next_power_of_2(latent_dim))
    block_r = max(32 if fp8 else 16, next_power_of_2(rope_dim))
    block_h, block_n, q_chunk = _tiles(rows, page, block_c, block_r, e_dot, dev.ub_bytes // 2, fp8)
    if tiles:
        block_h, block_n, q_chunk = tiles.get("BLOCK_H", block_h), tiles.get("BLOCK_N", block_n), tiles.get("Q_CHUNK", q_chunk)
        if page % block_n or block_c % max(q_chunk, 1):
            raise ValueError(f"BLOCK_N {block_n} must divide the block size {page} and Q_CHUNK {q_chunk} the padded latent width {block_c}")
        if fp8 and q_chunk != block_c // FP8_PARTS:
            raise ValueError(f"an FP8 cache's Q_CHUNK is the part width {block_c // FP8_PARTS}, got {q_chunk}")
    head_blocks = cdiv(rows, block_h)
    tiles = max(1, cdiv(capacity, block_n))
    if invariant:
        if num_splits is None:
            num_splits = min(MAX_SPLITS, cdiv(dev.num_aicore, head_blocks))  # one request fills the AI cores
        num_splits = max(1, int(num_splits))  # (never clamped by the block table's width: the batch's longest request)
    else:
        if num_splits is None:
            limit = min(MAX_SPLITS, tiles, max(1, capacity // MIN_TOKENS_PER_SPLIT))
            num_splits = pick_splits(batch * head_blocks, dev.num_aicore, limit)
        num_splits = max(1, min(int(num_splits), tiles))
    wide = not invariant and num_splits >= WIDE_MIN_SPLITS and batch * cdiv(rows, COMBINE_ROWS) < dev.num_vectorcore
    return {
        "BLOCK_H": block_h, "BLOCK_N": block_n, "Q_CHUNK": q_chunk, "BLOCK_C": block_c, "BLOCK_R": block_r,
        "head_blocks": head_blocks, "num_splits": num_splits, "wide_combine": wide,
        "MIN_SPLIT_TILES": INVARIANT_MIN_SPLIT_TOKENS // block_n if invariant else 0,
        "bytes": _tile_bytes(block_h, block_n, block_c, block_r, e_dot, q_chunk, fp8),
    }


def launch_mla_decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None = None,
    *,
    num_splits: int | None = None,
    tiles: dict | None = None,
    invariant: bool = False,
    wide_combine: bool | None = None,
) -> torch.Tensor:
    """mla_decode with an optional forced split count and tile overrides (BLOCK_H, BLOCK_N, Q_CHUNK):
    tests use them to exercise the combine and the C-chunked path on small shapes. invariant: the
    batch-invariant plan (deterministic mode, `plan`). wide_combine: force the wide (True) or the
    serial (False) combine instead of the plan's choice (tests)."""
    batch, num_queries, heads, latent_dim = q_nope.shape
    rope_dim = q_rope.shape[-1]
    _, page, _ = kv_cache.shape
    attention_ops.check_mla_decode_shapes(q_nope, q_rope, kv_cache, sliding_window)
    if page < 16 or page & (page - 1):
        raise ValueError(f"the ascend mla_decode kernel needs a power-of-two block size >= 16, got {page}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache rows must be contiguous (last stride 1)")
    fp8 = kv_cache_format.is_fp8(kv_cache)
    kv, kv_scales = fp8_views(kv_cache) if fp8 else (kv_cache, kv_cache)  # (kv_scales: unused without FP8)
    out = torch.empty(batch, num_queries, heads, latent_dim, dtype=q_nope.dtype, device=q_nope.device)
    if batch == 0 or num_queries == 0 or heads == 0 or latent_dim == 0:
        return out
    rows = num_queries * heads
    # [B, S*H, D] views with one row stride (a copy only for exotic strides).
    if q_nope.stride(-1) != 1 or q_nope.stride(1) != heads * q_nope.stride(2):
        q_nope = q_nope.contiguous()
    if q_rope.stride(-1) != 1 or q_rope.stride(1) != heads * q_rope.stride(2):
        q_rope = q_rope.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    if seq_lens.dtype != torch.int32:
        seq_lens = seq_lens.to(torch.int32)  # (a device-side cast, no synchronisation)

    if fp8:  # the e4m3 values convert exactly to q's dtype: the dots run in it
        dot_f32 = torch.float32 in (q_nope.dtype, q_rope.dtype) or q_nope.dtype != q_rope.dtype
    else:
        dot_f32 = q_nope.dtype == torch.float32 or kv_cache.dtype == torch.float32 or q_nope.dtype != kv_cache.dtype or q_rope.dtype != kv_cache.dtype
    e_dot = 4 if dot_f32 else q_nope.element_size()
    cfg = plan(batch, rows, page, block_table.shape[1] * page, latent_dim, rope_dim, e_dot, num_splits, tiles, fp8, invariant)
    splits = cfg["num_splits"]
    direct = splits == 1  # (deterministic mode: only where the chip and the model give one split to every call)
    if wide_combine and invariant:
        raise ValueError("deterministic mode merges in split order: no wide combine (its empty splits write no partial)")
    wide = not direct and (cfg["wide_combine"] if wide_combine is None else wide_combine)
    if direct:
        part_out = part_lse = out  # unused
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    else:
        part_out = torch.empty(batch, splits, rows, latent_dim, dtype=torch.float32, device=q_nope.device)
        if invariant:  # an empty split writes nothing: its lse stays -inf and its partial is never read
            part_lse = torch.full((batch, splits, rows), float("-inf"), dtype=torch.float32, device=q_nope.device)
        else:
            part_lse = torch.empty(batch, splits, rows, dtype=torch.float32, device=q_nope.device)
        po_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
        pl_strides = (part_lse.stride(0), part_lse.stride(1))
    manual_rne = interpreting() and q_nope.dtype == torch.bfloat16
    items = batch * cfg["head_blocks"] * splits
    _mla_decode_split_kernel[(cube_grid(items),)](
        q_nope, q_rope, kv, kv_scales, block_table, seq_lens,
        out, part_out, part_lse,
        float(softmax_scale),
        int(sliding_window or 0),
        items, cfg["head_blocks"], splits,
        q_nope.stride(0), q_nope.stride(2),
        q_rope.stride(0), q_rope.stride(2),
        kv.stride(0), kv.stride(1),
        block_table.stride(0),
        out.stride(0), out.stride(2),
        *po_strides,
        *pl_strides,
        S=num_queries, H=heads, C=latent_dim, R=rope_dim,
        BLOCK_C=cfg["BLOCK_C"], BLOCK_R=cfg["BLOCK_R"],
        PAGE=page,
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"],
        Q_CHUNK=cfg["Q_CHUNK"],
        HAS_WINDOW=sliding_window is not None,
        DIRECT=direct,
        DOT_F32=dot_f32 or upcast_dot(),
        DOT_PRECISION=dot_precision(dot_f32 or upcast_dot()),
        IDX64=kv_cache.numel() + kv_cache.stride(0) >= INT32_LIMIT,
        MANUAL_RNE=manual_rne,
        FP8=fp8,
        MIN_SPLIT_TILES=cfg["MIN_SPLIT_TILES"],
        **launch_options(),
    )
    if wide:
        col_blocks = cdiv(latent_dim, WIDE_COLS)
        combine_items = batch * rows * col_blocks
        _mla_decode_wide_combine_kernel[(vector_grid(combine_items),)](
            part_out, part_lse, out,
            combine_items, rows, col_blocks, splits,
            *po_strides,
            *pl_strides,
            out.stride(0), out.stride(2),
            C=latent_dim, CHUNK=min(WIDE_SPLITS, next_power_of_2(splits)), BLOCK_CC=WIDE_COLS,
            MANUAL_RNE=manual_rne,
            **launch_options(),
        )
    elif not direct:
        row_blocks = cdiv(rows, COMBINE_ROWS)
        combine_items = batch * row_blocks
        _mla_decode_combine_kernel[(vector_grid(combine_items),)](
            part_out, part_lse, out,
            combine_items, row_blocks, splits,
            *po_strides,
            *pl_strides,
            out.stride(0), out.stride(2),
            ROWS=rows, C=latent_dim,
            BLOCK_M=COMBINE_ROWS, BLOCK_C=cfg["BLOCK_C"],
            MANUAL_RNE=manual_rne,
            SKIP_EMPTY=invariant,
            **launch_options(),
        )
    return out


def mla_decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    return launch_mla_decode(q_nope, q_rope, kv_cache, block_table, seq_lens, softmax_scale, sliding_window)


def mla_decode_invariant(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    return launch_mla_decode(q_nope, q_rope, kv_cache, block_table, seq_lens, softmax_scale, sliding_window, invariant=True)


REGISTRATIONS = [
    Registration(
        op="mla_decode",
        fn=mla_decode,
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        note="Triton (ascend) heads as M, persistent cube grid over (request, head block, split), deterministic combine "
        "(wide over rows x 64 columns for small batches); "
        "FP8 cache decoded in four column parts (integer e4m3), row scales on scores and weights",
    ),
    Registration(
        op="mla_decode",
        fn=mla_decode_invariant,
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        priority=-1,
        batch_invariant=True,
        note="Triton (ascend) the kernel above with a split count from the chip and the head blocks only, "
        f"splits of >= {INVARIANT_MIN_SPLIT_TOKENS} tokens of each request's own range, empty splits skipped",
    ),
]
