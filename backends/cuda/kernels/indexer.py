"""Triton kernels: indexer_topk (DeepSeek-V4's Lightning Indexer: each query's top_k compressed entries).

score(t, e) = sum_h w[t, h] * relu(q[t, h] . keys[entry_rows[seq(t), e]]) over the entries
e < num_visible[t], w = float32(weights) * weights_scale (weights loaded in their dtype, the
projection's bfloat16 say, converted and scaled in the kernel: the model's own product, bit for bit);
the result is the rows entry_rows[seq(t), e] of the top_k entries e by score, equal scores lowest id
first, -1 past the visible ones (deepinfer.ops.indexer.indexer_topk). Two steps, no host
synchronisation (CUDA-graph safe):

Scores (`_indexer_scores_kernel`, grid (query blocks, entry blocks)): a program scores BLOCK_E
entries for BLOCK_T consecutive queries. The gathered key rows are the M side of a tensor-core
product and the query's heads the N side: logits[BLOCK_E, H] = keys [BLOCK_E, D] @ q[t]^T [D, H]
(float32 accumulation; float32 operands with input_precision "ieee", never tf32), then relu, times
weights[t, h] and a tl.sum over the heads along N (within a warp's registers; a fixed tree order)
- only the float32 score is written: scores [T, E], for the entries t sees. The key
tile is loaded once and kept while the next query belongs to the same sequence (a prefill's
queries are consecutive), so a sequence's keys are read once per BLOCK_T queries; BLOCK_T comes
from host-known shapes only (about T / B queries per sequence, at most 16; 1 in a decode batch). A
block wholly past num_visible[t] loads and writes nothing (decode batches mix short and long
sequences under one E, and a decode plan's E is E_max). Heads and D are padded to 16 (tl.dot's minimum) with zeros, which
add exactly 0 (relu(0) * 0); D is one tile (V4: 128). bfloat16 / float16 products are exact in
float32, so the scores differ from the reference's only by the order of the float32 sums.

A prefill score schedule, "multi_query" (`_indexer_scores_multi_query_kernel`; PREFILL_SCHEDULE or score_entries'
`prefill_schedule` picks it; the default since it ran on an H100, 2026-12-07): several queries per dot (logits [BLOCK_E, QN *
BLOCK_H], N up to 256 where the query loop's is the head count) in a loop over query groups that Triton pipelines (no
data-dependent branch in its body, clamped loads: the next group's q is copied while this group's dot and head sum
run), entry blocks first in the grid (the queries of the programs running at once share their q in L2, and a
sequence's keys stay there), programs past every query's visible entries doing nothing. It is taken where a sequence
has at least a group of queries (host-known shapes); decode batches keep the query loop. Its scores equal the query
loop's bit for bit in the interpreter (tests/cuda/test_indexer_multi_query.py); on a GPU the head sum's reduction
tree follows the accumulator's layout, which differs with N, so equality is not promised there (the same tests on an
H100 compare within a tolerance and passed, as did `deepinfer conformance --backend cuda` of the indexer ops) and
deterministic mode keeps the query loop. On that H100 (`bench ops --op indexer_topk`): T 8192 queries of one 64k-token
sequence 16.5 -> 6.9 ms (126 -> 301 TFLOP/s); the 8-layer V4-Flash prefill of 1 x 65536 tokens 1.069 -> 0.962 s.

Selection (`_indexer_select_kernel`, one launch when a row fits a chunk of 8192 entries: V4-Flash
decode up to 32k tokens of context; two up to 1M): a program holds a row's visible scores in registers as int32
order keys (the float's bits, negatives' magnitude bits flipped: integer order = float order, -0.0
folded into +0.0) and finds the k-th largest key exactly, bit by bit (32 counts of the row: the
largest x with #(keys >= x) >= k), then applies the reference's rule (`_top_ids_lowest_first`):
every key above kth, and the first room = k - #(above) keys equal to a finite kth in id order
(tl.cumsum), stored compacted in ascending id order as their entry rows, -1 after the last. Wider rows (long contexts)
run the same kernel per chunk, keeping each chunk's top k as candidates (order keys and ids, in id
order), and again over the candidates until they fit one chunk: a chunk gives the row's selection
at most k entries, which are its own top k under the same order, so nothing the row takes is lost.
Integer comparisons against an exact key: the tie rule holds bit for bit, and the result is the
same whatever the batch.

FP8 keys (deepinfer.ops.kv_cache_format, an FP8 cache's indexer pool) are gathered as bytes, their
e4m3 values converted exactly to q's dtype, and each key's float32 scale multiplies its score at
the end (relu(s * x) = s * relu(x) for s > 0).

Memory: the float32 scores [T, E] (4 bytes per query and entry; only the visible ones written)
and, for rows wider than a chunk, the candidates [T, chunks * k] (keys and ids). Offsets are int64
(T x E can pass 2^31 in a long prefill). float64 inputs (a test dtype) go to the reference.

Deterministic mode (`indexer_topk_invariant`): on a GPU the default is batch-invariant already: the
entry tile (BLOCK_E), BLOCK_H, BLOCK_D and the warps come from the head count and D only, entry
blocks are aligned to entry 0 of the sequence's table, and BLOCK_T is a loop over queries (each
query's dot and head sum are the same instructions whatever BLOCK_T), not a tile axis; the selection
is integer counting against an exact key. The invariant registration differs under the
interpreter only, where the default sizes the entry tile by the batch's padded table width: it
takes the GPU's entry tile there too (numpy's matmul may give a row other bits in another shape).
float64 (a test dtype) goes to the reference under `deepinfer.exact_order.invariant`.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer.ops import kv_cache_format
from deepinfer.ops.indexer import check_indexer_topk_shapes
from deepinfer.ops.indexer import indexer_topk as _reference
from deepinfer.triton_common import (
    cdiv,
    fp8_views,
    interpreting,
    last_dim_contiguous,
    next_power_of_2,
    pad_selection,
    selection_chunk,
    store_candidates,
    top_k_lowest_first,
    upcast_dot,
)
from deepinfer_cuda.kernels.common import Registration, dot_precision, pdl_launch, pdl_prologue

_MAX_BLOCK_T = 16  # queries per scoring program
_GPU_BLOCK_E = 128  # entries per scoring program on a GPU (fewer for D or heads > 128)
_GPU_TILE = 128 * 128  # elements of the key tile / the logits tile on a GPU
_INTERPRET_BLOCK_E = 1024  # under the interpreter: few, large programs
_GPU_SELECT_CHUNK = 8192  # scores a selection program holds in registers (16 warps, 16 a thread: 122 registers on sm90; 16384 spill)
_INTERPRET_SELECT_CHUNK = 8192
_MAX_BLOCK_K = 1024  # -1 padding written per step
# The prefill score schedule (score_entries): "query_loop" (`_indexer_scores_kernel`, one query per dot) or
# "multi_query" (`_indexer_scores_multi_query_kernel`: several queries per dot in a pipelined loop; measured in the module
# docstring). Decode batches (fewer queries per sequence than a group) and deterministic mode keep "query_loop".
PREFILL_SCHEDULE = "multi_query"
PREFILL_SCHEDULES = ("query_loop", "multi_query")
# multi_query on a GPU: queries per dot (N = queries x padded heads, at most 256), entries per program, queries per
# program, software-pipeline stages of the query-group loop, warps. On an H100 (2026-12-07, `bench ops --op indexer_topk`,
# T 8192 at 64k): 4 queries x 128 entries x 2 stages 6.90 ms; 2 queries (3 or 4 stages) 7.45-7.46; 64 entries 8.29. Three
# stages (231488 bytes of shared memory with Triton 3.9) needed 233536 with the GPU machine's Triton 3.6, over the 232448
# an sm90 block may take: two stages take 165920. 128 entries, since q (read from L2 for every entry block) costs 2 /
# block_e bytes per multiply-add; 4 queries (N 256): no spills on sm90 (223 registers) nor sm100 (2 queries spill there).
MULTI_QUERY_GPU = {"queries": 4, "block_e": 128, "block_t": 64, "num_stages": 2, "num_warps": 8}
_MULTI_QUERY_MAX_N = 256  # the widest wgmma N
_MAX_GRID_Y = 65535  # CUDA's grid y limit (multi_query's query blocks)
_NO_SEQ = tl.constexpr(2147483647)  # multi_query: "no sequence left"


@triton.jit
def _key_tile(q_ptr, keys_ptr, key_scale_ptr, rows_ptr, seq, D, stride_k, stride_rb, offs_e, e_in, offs_d, d_ok,
              DOT_F32: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """Sequence `seq`'s key tile [BLOCK_E, BLOCK_D] at entries offs_e as the dot operand (q's dtype, or float32 for
    DOT_F32), and each key's float32 scale (FP8 keys; 1 otherwise). FP8 keys are e4m3 bytes, exact in q's dtype, their
    scale applied to the score afterwards: relu(s * x) = s * relu(x) for the scale s > 0."""
    rows = tl.load(rows_ptr + seq.to(tl.int64) * stride_rb + offs_e, mask=e_in, other=0)
    rows = tl.maximum(rows.to(tl.int64), 0)  # -1 past a table's last entry: never visible
    keys = tl.load(keys_ptr + rows[:, None] * stride_k + offs_d[None, :], mask=e_in[:, None] & d_ok[None, :], other=0.0)
    key_scale = tl.full(offs_e.shape, 1.0, tl.float32)
    if FP8:
        keys = keys.to(tl.float8e4nv, bitcast=True)
        key_scale = tl.load(key_scale_ptr + (rows * stride_k + D) // 4, mask=e_in, other=0.0)
        keys = keys.to(tl.float32) if DOT_F32 else keys.to(q_ptr.dtype.element_ty)
    elif DOT_F32:
        keys = keys.to(tl.float32)
    return keys, key_scale


@triton.jit(do_not_specialize=["T"])
def _indexer_scores_kernel(
    q_ptr, w_ptr, keys_ptr, key_scale_ptr, rows_ptr, seq_ptr, nv_ptr, scores_ptr,
    T, E, H, D, w_scale,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_k, stride_rb, stride_s,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,  # FP8 keys: keys_ptr their bytes, key_scale_ptr the same memory as float32
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    t0 = tl.program_id(0) * BLOCK_T
    first = tl.program_id(1) * BLOCK_E
    offs_e = first + tl.arange(0, BLOCK_E)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    e_in = offs_e < E
    h_ok = offs_h < H
    d_ok = offs_d < D
    # The key tile [BLOCK_E, D] of the sequence `cur`: reloaded only when the next query's sequence differs.
    if DOT_F32:
        keys = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
    elif FP8:
        keys = tl.zeros([BLOCK_E, BLOCK_D], dtype=q_ptr.dtype.element_ty)
    else:
        keys = tl.zeros([BLOCK_E, BLOCK_D], dtype=keys_ptr.dtype.element_ty)
    key_scale = tl.full([BLOCK_E], 1.0, tl.float32)
    cur = tl.program_id(0) * 0 - 1
    for i in range(0, BLOCK_T):
        t = t0 + i
        if t < T:
            t64 = t.to(tl.int64)
            nv = tl.minimum(tl.maximum(tl.load(nv_ptr + t64).to(tl.int32), 0), E)
            dst = scores_ptr + t64 * stride_s + offs_e
            if first < nv:
                seq = tl.load(seq_ptr + t64).to(tl.int32)
                if seq != cur:
                    keys, key_scale = _key_tile(q_ptr, keys_ptr, key_scale_ptr, rows_ptr, seq, D, stride_k, stride_rb, offs_e, e_in, offs_d, d_ok,
                                                DOT_F32, FP8)  # fmt: skip
                    cur = seq
                qt = tl.load(q_ptr + t64 * stride_qt + offs_h[None, :] * stride_qh + offs_d[:, None], mask=d_ok[:, None] & h_ok[None, :], other=0.0)
                if DOT_F32:
                    qt = qt.to(tl.float32)
                logits = tl.dot(keys, qt, input_precision=DOT_PRECISION)  # [BLOCK_E, BLOCK_H], float32
                w = tl.load(w_ptr + t64 * stride_wt + offs_h * stride_wh, mask=h_ok, other=0.0).to(tl.float32) * w_scale
                score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1)
                if FP8:
                    score = score * key_scale
                tl.store(dst, score, mask=offs_e < nv)  # (nothing past num_visible: the selection never reads it)


@triton.jit(do_not_specialize=["T"])
def _indexer_scores_multi_query_kernel(
    q_ptr, w_ptr, keys_ptr, key_scale_ptr, rows_ptr, seq_ptr, nv_ptr, scores_ptr,
    T, E, H, D, w_scale,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_k, stride_rb, stride_s,
    BLOCK_T: tl.constexpr,  # queries per program (a multiple of QN)
    QN: tl.constexpr,  # queries per dot
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,  # FP8 keys: keys_ptr their bytes, key_scale_ptr the same memory as float32
    NUM_STAGES: tl.constexpr,  # software-pipeline stages of the query-group loop
    MASK_HD: tl.constexpr,  # heads or D padded (BLOCK_H > H or BLOCK_D > D): mask them; V4 (64 x 128) needs no mask
    PDL: tl.constexpr = False,
):
    """Schedule "multi_query": a program scores the entry block
    [program_id(0) * BLOCK_E, + BLOCK_E) for the queries [program_id(1) * BLOCK_T, + BLOCK_T). The key
    tile is loaded once per sequence among those queries (one in a prefill chunk), then a loop over
    groups of QN consecutive queries makes one dot per group: logits [BLOCK_E, QN * BLOCK_H] = keys @
    q_group^T, column c = query c // BLOCK_H, head c % BLOCK_H (N = 256 at 64 heads and QN 4, where
    the query loop's N is 64). The loop body has no data-dependent branch and only in-bounds loads
    (token indices clamped to T - 1; only the store is masked), so Triton can pipeline it: the next
    group's q loads while this group's dot and head sum run.

    A program whose queries belong to several sequences (a batch's boundary) runs the group loop once
    per sequence, storing only that sequence's queries: every score comes from the same arithmetic
    whatever the batch. A program none of whose queries sees its first entry (past the causal
    diagonal) loads nothing but the queries' sequences and visible counts."""
    pdl_prologue(PDL)
    first = tl.program_id(0) * BLOCK_E
    t0 = tl.program_id(1) * BLOCK_T
    offs_e = first + tl.arange(0, BLOCK_E)
    e_in = offs_e < E
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = (offs_d < D) | (not MASK_HD)
    offs_t = t0 + tl.arange(0, BLOCK_T)
    t_in = offs_t < T
    seqs = tl.load(seq_ptr + offs_t.to(tl.int64), mask=t_in, other=0).to(tl.int32)
    nvs = tl.minimum(tl.maximum(tl.load(nv_ptr + offs_t.to(tl.int64), mask=t_in, other=0).to(tl.int32), 0), E)
    sees = t_in & (nvs > first)  # queries that see an entry of this block
    group_of = tl.arange(0, BLOCK_T) // QN
    offs_c = tl.arange(0, QN * BLOCK_H)  # a group's operand rows / logits columns: query c // BLOCK_H, head c % BLOCK_H
    col_q = offs_c // BLOCK_H
    col_h = offs_c % BLOCK_H
    col_ok = (col_h < H) | (not MASK_HD)
    offs_g = tl.arange(0, QN)
    seq = tl.min(tl.where(sees, seqs, _NO_SEQ))
    while seq != _NO_SEQ:  # one pass per sequence among the program's queries that see the block
        member = sees & (seqs == seq)
        g_lo = tl.min(tl.where(member, group_of, BLOCK_T))  # groups from the first to the last with a member
        g_hi = tl.max(tl.where(member, group_of, -1)) + 1
        keys, key_scale = _key_tile(q_ptr, keys_ptr, key_scale_ptr, rows_ptr, seq, D, stride_k, stride_rb, offs_e, e_in, offs_d, d_ok, DOT_F32, FP8)
        for g in tl.range(g_lo, g_hi, num_stages=NUM_STAGES):
            tg = t0 + g * QN
            t_col = tl.minimum(tg + col_q, T - 1).to(tl.int64)  # clamped: past T loads query T - 1's, never stored
            qg = tl.load(q_ptr + t_col[:, None] * stride_qt + col_h[:, None] * stride_qh + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            if DOT_F32:
                qg = qg.to(tl.float32)
            w = tl.load(w_ptr + t_col * stride_wt + col_h * stride_wh, mask=col_ok, other=0.0).to(tl.float32) * w_scale
            t_g = tg + offs_g
            t_g64 = tl.minimum(t_g, T - 1).to(tl.int64)
            nv_g = tl.minimum(tl.maximum(tl.load(nv_ptr + t_g64).to(tl.int32), 0), E)
            keep = (t_g < T) & (tl.load(seq_ptr + t_g64).to(tl.int32) == seq)
            logits = tl.dot(keys, tl.trans(qg), input_precision=DOT_PRECISION)  # [BLOCK_E, QN * BLOCK_H], float32
            # The head sum over the last axis of [BLOCK_E, QN, BLOCK_H]: per query the query loop's [BLOCK_E, BLOCK_H] sum
            score = tl.sum(tl.reshape(tl.maximum(logits, 0.0) * w[None, :], [BLOCK_E, QN, BLOCK_H]), axis=2)  # [BLOCK_E, QN]
            if FP8:
                score = score * key_scale[:, None]
            dst = scores_ptr + t_g64[None, :] * stride_s + offs_e[:, None]
            tl.store(dst, score, mask=keep[None, :] & (offs_e[:, None] < nv_g[None, :]))  # (nothing past num_visible)
        seq = tl.min(tl.where(sees & (seqs > seq), seqs, _NO_SEQ))


@triton.jit
def _indexer_select_kernel(
    src_ptr, src_ids_ptr, nv_ptr, dst_ptr, dst_ids_ptr, rows_ptr, seq_ptr,
    width, TOP_K,
    stride_src, stride_dst, stride_rb,
    CHUNK: tl.constexpr,
    FIRST: tl.constexpr,  # src: the float32 scores (ids: their columns, valid below num_visible); else candidate keys and ids
    LAST: tl.constexpr,  # write the row's ids (dst_ids [T, TOP_K], -1 after the last); else this chunk's candidates
    ROWS: tl.constexpr,  # LAST writes entry_rows[token_seq[t], id] (rows_ptr, seq_ptr) instead of the ids
    BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    """Per (query, chunk of CHUNK entries): the chunk's top TOP_K by (score, then lowest id), in id
    order. LAST (one chunk holds the row): the row's selection. Otherwise the chunk's candidates
    (order keys and ids at dst[t, c * TOP_K:], ORDER_KEY_NONE / -1 after them): every entry the row's
    selection takes from the chunk is among them (a chunk gives at most TOP_K, and the row's order
    restricted to the chunk is the chunk's), and chunk after chunk they stay in id order."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    keys, ids = selection_chunk(src_ptr, src_ids_ptr, nv_ptr, t, offs, width, stride_src, FIRST)
    take, pos, taken = top_k_lowest_first(keys, TOP_K)
    if LAST:
        out_row = dst_ids_ptr + t * stride_dst
        if ROWS:
            seq = tl.load(seq_ptr + t).to(tl.int64)
            tl.store(out_row + pos, tl.load(rows_ptr + seq * stride_rb + ids, mask=take, other=-1), mask=take)
        else:
            tl.store(out_row + pos, ids, mask=take)
        pad_selection(out_row, out_row, taken, TOP_K, BLOCK_K, False)
    else:
        out_row = dst_ids_ptr + t * stride_dst + c * TOP_K
        key_row = dst_ptr + t * stride_dst + c * TOP_K
        store_candidates(key_row, out_row, keys, ids, take, pos)
        pad_selection(key_row, out_row, taken, TOP_K, BLOCK_K, True)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    entry_rows: torch.Tensor,
    token_seq: torch.Tensor,
    num_visible: torch.Tensor,
    *,
    top_k: int,
    weights_scale: float = 1.0,
) -> torch.Tensor:
    return launch_indexer_topk(q, weights, index_keys, entry_rows, token_seq, num_visible, top_k, weights_scale=weights_scale)


def indexer_topk_invariant(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    entry_rows: torch.Tensor,
    token_seq: torch.Tensor,
    num_visible: torch.Tensor,
    *,
    top_k: int,
    weights_scale: float = 1.0,
) -> torch.Tensor:
    return launch_indexer_topk(q, weights, index_keys, entry_rows, token_seq, num_visible, top_k, weights_scale=weights_scale, invariant=True)


def launch_indexer_topk(q, weights, index_keys, entry_rows, token_seq, num_visible, top_k, *, weights_scale: float = 1.0,
                        invariant: bool = False, select_chunk: int | None = None, prefill_schedule: str | None = None,
                        multi_query: dict | None = None) -> torch.Tensor:  # fmt: skip
    """indexer_topk; invariant: the GPU's entry tile under the interpreter too (deterministic mode);
    select_chunk: the selection's chunk (tests force several launches with a small one);
    prefill_schedule, multi_query: the scores' (score_entries)."""
    check_indexer_topk_shapes(q, weights, index_keys, entry_rows, token_seq, num_visible)
    if q.dtype == torch.float64 or index_keys.dtype == torch.float64:
        reference = _invariant_reference() if invariant else _reference
        return reference(q, weights, index_keys, entry_rows, token_seq, num_visible, top_k=top_k, weights_scale=weights_scale)
    tokens, heads, dim = q.shape
    max_entries = entry_rows.shape[1]
    k = min(top_k, max_entries)
    if tokens == 0 or k <= 0:
        return torch.full((tokens, top_k), -1, dtype=torch.int32, device=q.device)
    q, index_keys, entry_rows = last_dim_contiguous(q, index_keys, entry_rows)
    token_seq = token_seq.contiguous()
    num_visible = num_visible.contiguous()
    scores = score_entries(q, weights, index_keys, entry_rows, token_seq, num_visible, weights_scale=weights_scale, invariant=invariant,
                           prefill_schedule=prefill_schedule, multi_query=multi_query)  # fmt: skip
    return select_topk(scores, num_visible, top_k, entry_rows=entry_rows, token_seq=token_seq, chunk=select_chunk)


def score_entries(q, weights, index_keys, entry_rows, token_seq, num_visible, *, weights_scale: float = 1.0, invariant: bool = False,
                  prefill_schedule: str | None = None, multi_query: dict | None = None) -> torch.Tensor:  # fmt: skip
    """[T, E] float32: the indexer's score of each query's visible entries (columns at or past
    num_visible[t] are not written), weights taken as float32(weights) * weights_scale.
    q, index_keys, entry_rows last-dim contiguous;
    token_seq and num_visible contiguous; not float64. The V4.1 candidate kernels score with it too.
    prefill_schedule: "query_loop" (`_indexer_scores_kernel`) or "multi_query" (`_indexer_scores_multi_query_kernel`,
    taken where a sequence has at least a group of queries: prefill); None: PREFILL_SCHEDULE, but "query_loop" when
    invariant (deterministic mode: the batch invariance argued in the module docstring is the query loop's).
    multi_query: entries of MULTI_QUERY_GPU to override (a sweep's; on a GPU and under the interpreter)."""
    if prefill_schedule is None:
        prefill_schedule = "query_loop" if invariant else PREFILL_SCHEDULE
    if prefill_schedule not in PREFILL_SCHEDULES:
        raise ValueError(f"unknown indexer prefill schedule {prefill_schedule!r}; valid: {', '.join(PREFILL_SCHEDULES)}")
    tokens, heads, dim = q.shape
    max_entries = entry_rows.shape[1]
    scores = torch.empty(tokens, max_entries, dtype=torch.float32, device=q.device)
    if tokens == 0 or max_entries == 0:
        return scores
    fp8 = kv_cache_format.is_fp8(index_keys)
    keys, key_scales = fp8_views(index_keys) if fp8 else (index_keys, index_keys)
    # (FP8 keys convert to q's dtype exactly)
    dot_f32 = q.dtype == torch.float32 or (not fp8 and (index_keys.dtype == torch.float32 or q.dtype != index_keys.dtype))
    block_h = max(16, next_power_of_2(heads))
    block_d = max(16, next_power_of_2(dim))
    if prefill_schedule == "multi_query":
        plan = _multi_query_plan(tokens, entry_rows.shape[0], max_entries, block_h, multi_query or {})
        if plan is not None:
            _launch_multi_query(q, weights, keys, key_scales, entry_rows, token_seq, num_visible, scores, weights_scale, fp8, dot_f32, block_h, block_d, plan)
            return scores
    # Queries per program: about the queries per sequence (host-known shapes: a prefill's queries share
    # their sequence's key tiles; a decode batch has one query per sequence).
    block_t = max(1, min(next_power_of_2(tokens // max(entry_rows.shape[0], 1)), _MAX_BLOCK_T))
    if interpreting() and not invariant:
        block_e = max(16, min(next_power_of_2(max_entries), _INTERPRET_BLOCK_E))
        block_t = max(block_t, min(next_power_of_2(tokens), _MAX_BLOCK_T))
    else:
        block_e = max(16, min(_GPU_BLOCK_E, _GPU_TILE // max(block_d, block_h)))
    _indexer_scores_kernel[(cdiv(tokens, block_t), cdiv(max_entries, block_e))](
        q, weights, keys, key_scales, entry_rows, token_seq, num_visible, scores,
        tokens, max_entries, heads, dim, float(weights_scale),
        q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), keys.stride(0), entry_rows.stride(0), scores.stride(0),
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_E=block_e,
        DOT_F32=dot_f32 or upcast_dot(),
        DOT_PRECISION=dot_precision(dot_f32 or upcast_dot()),
        FP8=fp8,
        num_warps=8 if block_e * max(block_d, block_h) >= 128 * 128 else 4, **pdl_launch(q.device),
    )
    return scores


def _multi_query_plan(tokens: int, sequences: int, max_entries: int, block_h: int, overrides: dict) -> dict | None:
    """multi_query's launch sizes from host-known shapes (MULTI_QUERY_GPU with `overrides`), or None where fewer
    queries per sequence than a group (a decode batch: the query loop). Under the interpreter the entry block is
    as wide as the table (up to _INTERPRET_BLOCK_E) unless overridden: few, large programs."""
    unknown = set(overrides) - set(MULTI_QUERY_GPU)
    if unknown:
        raise ValueError(f"unknown multi_query settings {sorted(unknown)}; valid: {', '.join(MULTI_QUERY_GPU)}")
    plan = dict(MULTI_QUERY_GPU)
    if interpreting():
        plan["block_e"] = max(16, min(next_power_of_2(max_entries), _INTERPRET_BLOCK_E))
    plan.update(overrides)
    per_sequence = max(1, tokens // max(sequences, 1))
    qn = min(plan["queries"], max(1, _MULTI_QUERY_MAX_N // block_h))
    if per_sequence < qn:
        return None
    block_t = max(qn, min(plan["block_t"], next_power_of_2(per_sequence)))
    block_t = max(block_t, next_power_of_2(cdiv(tokens, _MAX_GRID_Y)))  # (a grid y within CUDA's limit)
    return {**plan, "queries": qn, "block_t": block_t}


def _launch_multi_query(q, weights, keys, key_scales, entry_rows, token_seq, num_visible, scores, weights_scale, fp8, dot_f32, block_h, block_d, plan):
    """`_indexer_scores_multi_query_kernel` over scores [T, E] (score_entries' inputs, prepared). Grid: entry blocks
    first, so the programs running at once share their queries' q (in L2) and read the sequence's keys, which
    stay in L2 too (16384 keys of 256 bytes: 4 MiB)."""
    tokens, heads, dim = q.shape
    max_entries = entry_rows.shape[1]
    block_e, block_t = plan["block_e"], plan["block_t"]
    _indexer_scores_multi_query_kernel[(cdiv(max_entries, block_e), cdiv(tokens, block_t))](
        q, weights, keys, key_scales, entry_rows, token_seq, num_visible, scores,
        tokens, max_entries, heads, dim, float(weights_scale),
        q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), keys.stride(0), entry_rows.stride(0), scores.stride(0),
        BLOCK_T=block_t, QN=plan["queries"], BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_E=block_e,
        DOT_F32=dot_f32 or upcast_dot(),
        DOT_PRECISION=dot_precision(dot_f32 or upcast_dot()),
        FP8=fp8, NUM_STAGES=plan["num_stages"], MASK_HD=block_h != heads or block_d != dim,
        num_warps=plan["num_warps"], **pdl_launch(q.device),
    )


def select_topk(
    scores: torch.Tensor, num_visible: torch.Tensor, top_k: int, *, entry_rows: torch.Tensor | None = None, token_seq: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """[T, top_k] int32: each row's top_k columns below num_visible[t] by score, equal scores lowest
    column first, in column order, -1 after the last (the reference's `_top_ids_lowest_first`); with
    entry_rows and token_seq, entry_rows[token_seq[t], column] instead of the column. Rows wider than
    `chunk` are cut into chunks whose candidates the next launch selects from."""
    tokens, width = scores.shape
    cap = chunk or (_INTERPRET_SELECT_CHUNK if interpreting() else _GPU_SELECT_CHUNK)
    cap = max(cap, 4 * next_power_of_2(top_k))  # each launch keeps at most a quarter of its input
    if cap >= 1 << 16:
        raise ValueError(f"indexer_topk's selection takes top_k up to 16384 (its counts are 16-bit), got {top_k}")
    block_k = max(16, min(next_power_of_2(top_k), _MAX_BLOCK_K))
    src, src_ids, first = scores, scores, True
    while True:
        block = max(16, min(cap, next_power_of_2(width)))
        n_chunks = cdiv(width, block)
        last = n_chunks == 1
        if last:
            dst = dst_ids = torch.empty(tokens, top_k, dtype=torch.int32, device=scores.device)
        else:
            dst = torch.empty(tokens, n_chunks * top_k, dtype=torch.int32, device=scores.device)
            dst_ids = torch.empty_like(dst)
        rows = entry_rows is not None and last
        _indexer_select_kernel[(tokens, n_chunks)](
            src, src_ids, num_visible, dst, dst_ids, entry_rows if rows else dst, token_seq if rows else dst,
            width, top_k,
            src.stride(0), dst.stride(0), entry_rows.stride(0) if rows else 0,
            CHUNK=block, FIRST=first, LAST=last, ROWS=rows, BLOCK_K=block_k,
            num_warps=max(4, min(16, block // 512)), **pdl_launch(src.device),
        )
        if last:
            return dst_ids
        src, src_ids, width, first = dst, dst_ids, n_chunks * top_k, False


@lru_cache(maxsize=None)
def _invariant_reference():
    from deepinfer.exact_order import invariant

    return invariant(_reference)


REGISTRATIONS = [
    Registration(
        op="indexer_topk",
        fn=indexer_topk,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        note="Triton: heads x entries tensor-core scores over the visible entries, in-register exact k-th key + ordered tie-rule select",
    ),
    Registration(
        op="indexer_topk",
        fn=indexer_topk_invariant,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        priority=-1,
        batch_invariant=True,
        note="Triton: heads x entries tensor-core scores, in-register exact k-th key + ordered tie-rule select; the GPU's entry tile under the interpreter too",
    ),
]
