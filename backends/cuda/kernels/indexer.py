"""Triton kernels: indexer_topk (DeepSeek-V4's Lightning Indexer: each query's top_k compressed entries).

score(t, e) = sum_h weights[t, h] * relu(q[t, h] . keys[entry_rows[seq(t), e]]) over the entries
e < num_visible[t]; the result is the top_k entry ids by score, equal scores lowest id first, -1
past the visible ones (deepinfer.ops.indexer.indexer_topk). Two steps, no host synchronisation
(CUDA-graph safe):

Scores (`_indexer_scores_kernel`, grid (query blocks, entry blocks)): a program scores BLOCK_E
entries for BLOCK_T consecutive queries. The gathered key rows are the M side of a tensor-core
product and the query's heads the N side: logits[BLOCK_E, H] = keys [BLOCK_E, D] @ q[t]^T [D, H]
(float32 accumulation; float32 operands with input_precision "ieee", never tf32), then relu, times
weights[t, h] and a tl.sum over the heads along N (within a warp's registers; a fixed tree order)
- only the float32 score is written: scores [T, E], -inf for the entries t does not see. The key
tile is loaded once and kept while the next query belongs to the same sequence (a prefill's
queries are consecutive), so a sequence's keys are read once per BLOCK_T queries; BLOCK_T comes
from host-known shapes only (about T / B queries per sequence, at most 16; 1 in a decode batch). A
block wholly past num_visible[t] writes -inf without loading anything (decode batches mix short
and long sequences under one E). Heads and D are padded to 16 (tl.dot's minimum) with zeros, which
add exactly 0 (relu(0) * 0); D is one tile (V4: 128). bfloat16 / float16 products are exact in
float32, so the scores differ from the reference's only by the order of the float32 sums.

Selection: torch.topk(scores, k, sorted=False) gives the k-th largest score kth (the minimum of the
returned values, an element's exact value), then two kernels over (query, chunk of BLOCK entries)
apply the reference's rule (`_top_ids_lowest_first`): every score > kth is taken, and the first
room = k - #(topk values > kth) finite scores == kth in id order. `_indexer_count_kernel` counts
each chunk's scores > kth and == kth; `_indexer_select_kernel` sums the counts of the chunks
before its own (the ids taken before it: above + min(ties, room)), ranks its ties and its taken
ids with tl.cumsum and stores the taken ids at their ranks, so each row comes out compacted in
ascending id order (as the reference's does), -1 after the last (written by chunk 0). Chunks
rather than one program per query: a decode step has few queries over up to 256k entries.

Why torch glue for the threshold rather than an in-kernel radix select: torch.topk is one tuned
radix select on the GPU (and runs on the CPU under the interpreter), and since the threshold it
yields is an element's exact value, the tie rule is reproduced bit for bit by comparisons alone;
an in-kernel select would need per-query digit histograms (atomics, several passes) or ~32
bisection passes over rows of up to 256k entries.

FP8 keys (deepinfer.ops.kv_cache_format, an FP8 cache's indexer pool) are gathered as bytes, their
e4m3 values converted exactly to q's dtype, and each key's float32 scale multiplies its score at
the end (relu(s * x) = s * relu(x) for s > 0).

Memory: the float32 scores [T, E] (4 bytes per query and entry), topk's values [T, k] and the
chunk counts [T, 2 * chunks]. Offsets are int64 (T x E can pass 2^31 in a long prefill). float64
inputs (a test dtype) go to the reference.

Deterministic mode (`indexer_topk_invariant`): on a GPU the default is batch-invariant already: the
entry tile (BLOCK_E), BLOCK_H, BLOCK_D and the warps come from the head count and D only, entry
blocks are aligned to entry 0 of the sequence's table, and BLOCK_T is a loop over queries (each
query's dot and head sum are the same instructions whatever BLOCK_T), not a tile axis; the selection
is integer counting against an exact threshold. The invariant registration differs under the
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
from deepinfer.triton_common import cdiv, fp8_views, interpreting, last_dim_contiguous, next_power_of_2, upcast_dot
from deepinfer_cuda.kernels.common import Registration, dot_precision

_MAX_BLOCK_T = 16  # queries per scoring program
_GPU_BLOCK_E = 128  # entries per scoring program on a GPU (fewer for D or heads > 128)
_GPU_TILE = 128 * 128  # elements of the key tile / the logits tile on a GPU
_INTERPRET_BLOCK_E = 1024  # under the interpreter: few, large programs
_GPU_SELECT_BLOCK = 2048  # scores per selection program (one chunk of a row)
_INTERPRET_SELECT_BLOCK = 8192
_MAX_BLOCK_K = 1024  # topk values read per step


@triton.jit(do_not_specialize=["T"])
def _indexer_scores_kernel(
    q_ptr, w_ptr, keys_ptr, key_scale_ptr, rows_ptr, seq_ptr, nv_ptr, scores_ptr,
    T, E, H, D,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_k, stride_rb, stride_s,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,  # FP8 keys: keys_ptr their bytes, key_scale_ptr the same memory as float32
):
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
                    rows = tl.load(rows_ptr + seq.to(tl.int64) * stride_rb + offs_e, mask=e_in, other=0)
                    rows = tl.maximum(rows.to(tl.int64), 0)  # -1 past a table's last entry: never visible
                    k = tl.load(keys_ptr + rows[:, None] * stride_k + offs_d[None, :], mask=e_in[:, None] & d_ok[None, :], other=0.0)
                    if FP8:
                        # e4m3 values, exact in q's dtype; relu(s * x) = s * relu(x) for the scale s > 0
                        k = k.to(tl.float8e4nv, bitcast=True)
                        key_scale = tl.load(key_scale_ptr + (rows * stride_k + D) // 4, mask=e_in, other=0.0)
                        k = k.to(tl.float32) if DOT_F32 else k.to(q_ptr.dtype.element_ty)
                    elif DOT_F32:
                        k = k.to(tl.float32)
                    keys = k
                    cur = seq
                qt = tl.load(q_ptr + t64 * stride_qt + offs_h[None, :] * stride_qh + offs_d[:, None], mask=d_ok[:, None] & h_ok[None, :], other=0.0)
                if DOT_F32:
                    qt = qt.to(tl.float32)
                logits = tl.dot(keys, qt, input_precision=DOT_PRECISION)  # [BLOCK_E, BLOCK_H], float32
                w = tl.load(w_ptr + t64 * stride_wt + offs_h * stride_wh, mask=h_ok, other=0.0).to(tl.float32)
                score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1)
                if FP8:
                    score = score * key_scale
                tl.store(dst, tl.where(offs_e < nv, score, float("-inf")), mask=e_in)
            else:
                tl.store(dst, tl.full([BLOCK_E], float("-inf"), tl.float32), mask=e_in)


@triton.jit
def _kth_and_room(topv_ptr, t, K, stride_v, BLOCK_K: tl.constexpr):
    """The k-th largest score of query t (the minimum of topk's k values: an element's exact value)
    and how many scores equal to it are taken (k minus those above it)."""
    offs_k = tl.arange(0, BLOCK_K)
    top_row = topv_ptr + t * stride_v
    kth = tl.min(tl.load(top_row + offs_k, mask=offs_k < K, other=float("inf")), axis=0)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kth = tl.minimum(kth, tl.min(tl.load(top_row + k0 + offs_k, mask=k0 + offs_k < K, other=float("inf")), axis=0))
    above = tl.sum((tl.load(top_row + offs_k, mask=offs_k < K, other=float("-inf")) > kth).to(tl.int32), axis=0)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        above += tl.sum((tl.load(top_row + k0 + offs_k, mask=k0 + offs_k < K, other=float("-inf")) > kth).to(tl.int32), axis=0)
    return kth, K - above


@triton.jit
def _indexer_count_kernel(
    scores_ptr, topv_ptr, counts_ptr,
    E, K,
    stride_s, stride_v, stride_c,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Per (query, chunk of BLOCK entries): how many scores are > kth and how many equal it (finite)."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    kth, room = _kth_and_room(topv_ptr, t, K, stride_v, BLOCK_K)
    e = c * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(scores_ptr + t * stride_s + e, mask=e < E, other=float("-inf"))
    above = tl.sum((s > kth).to(tl.int32), axis=0)
    tied = tl.sum(((s == kth) & (s > float("-inf")) & (s < float("inf"))).to(tl.int32), axis=0)
    tl.store(counts_ptr + t * stride_c + 2 * c, above)
    tl.store(counts_ptr + t * stride_c + 2 * c + 1, tied)


@triton.jit
def _indexer_select_kernel(
    scores_ptr, topv_ptr, counts_ptr, out_ptr,
    E, K, TOP_K, n_chunks,
    stride_s, stride_v, stride_c, stride_o,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Per (query, chunk): the chunk's taken ids (every score > kth, and the ties while the first
    `room` ties of the row in id order last), at their ranks in the row's ascending id list."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    kth, room = _kth_and_room(topv_ptr, t, K, stride_v, BLOCK_K)
    offs_c = tl.arange(0, BLOCK_C)
    count_row = counts_ptr + t * stride_c + 2 * offs_c
    above_c = tl.load(count_row, mask=offs_c < n_chunks, other=0)
    tied_c = tl.load(count_row + 1, mask=offs_c < n_chunks, other=0)
    before = offs_c < c
    tied_before = tl.sum(tl.where(before, tied_c, 0), axis=0)
    taken_before = tl.sum(tl.where(before, above_c, 0), axis=0) + tl.minimum(tied_before, room)
    e = c * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(scores_ptr + t * stride_s + e, mask=e < E, other=float("-inf"))
    tied = ((s == kth) & (s > float("-inf")) & (s < float("inf"))).to(tl.int32)
    take = (s > kth) | ((tied != 0) & (tied_before + tl.cumsum(tied, axis=0) <= room))
    pos = taken_before + tl.cumsum(take.to(tl.int32), axis=0) - 1
    out_row = out_ptr + t * stride_o
    tl.store(out_row + pos, e, mask=take)
    if c == 0:  # -1 after the row's last taken id
        taken = tl.sum(above_c, axis=0) + tl.minimum(tl.sum(tied_c, axis=0), room)
        for p0 in range(0, TOP_K, BLOCK_K):
            p = p0 + tl.arange(0, BLOCK_K)
            tl.store(out_row + p, tl.full([BLOCK_K], -1, tl.int32), mask=(p >= taken) & (p < TOP_K))


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    entry_rows: torch.Tensor,
    token_seq: torch.Tensor,
    num_visible: torch.Tensor,
    *,
    top_k: int,
) -> torch.Tensor:
    return launch_indexer_topk(q, weights, index_keys, entry_rows, token_seq, num_visible, top_k)


def indexer_topk_invariant(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    entry_rows: torch.Tensor,
    token_seq: torch.Tensor,
    num_visible: torch.Tensor,
    *,
    top_k: int,
) -> torch.Tensor:
    return launch_indexer_topk(q, weights, index_keys, entry_rows, token_seq, num_visible, top_k, invariant=True)


def launch_indexer_topk(q, weights, index_keys, entry_rows, token_seq, num_visible, top_k, *, invariant: bool = False) -> torch.Tensor:
    """indexer_topk; invariant: the GPU's entry tile under the interpreter too (deterministic mode)."""
    check_indexer_topk_shapes(q, weights, index_keys, entry_rows, token_seq, num_visible)
    if q.dtype == torch.float64 or index_keys.dtype == torch.float64:
        reference = _invariant_reference() if invariant else _reference
        return reference(q, weights, index_keys, entry_rows, token_seq, num_visible, top_k=top_k)
    tokens, heads, dim = q.shape
    max_entries = entry_rows.shape[1]
    k = min(top_k, max_entries)
    if tokens == 0 or k <= 0:
        return torch.full((tokens, top_k), -1, dtype=torch.int32, device=q.device)
    q, index_keys, entry_rows = last_dim_contiguous(q, index_keys, entry_rows)
    token_seq = token_seq.contiguous()
    num_visible = num_visible.contiguous()

    scores = torch.empty(tokens, max_entries, dtype=torch.float32, device=q.device)
    fp8 = kv_cache_format.is_fp8(index_keys)
    keys, key_scales = fp8_views(index_keys) if fp8 else (index_keys, index_keys)
    # (FP8 keys convert to q's dtype exactly)
    dot_f32 = q.dtype == torch.float32 or (not fp8 and (index_keys.dtype == torch.float32 or q.dtype != index_keys.dtype))
    block_h = max(16, next_power_of_2(heads))
    block_d = max(16, next_power_of_2(dim))
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
        tokens, max_entries, heads, dim,
        q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), keys.stride(0), entry_rows.stride(0), scores.stride(0),
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_E=block_e,
        DOT_F32=dot_f32 or upcast_dot(),
        DOT_PRECISION=dot_precision(dot_f32 or upcast_dot()),
        FP8=fp8,
        num_warps=8 if block_e * max(block_d, block_h) >= 128 * 128 else 4,
    )

    top = torch.topk(scores, k, dim=1, sorted=False).values
    block = max(16, min(next_power_of_2(max_entries), _INTERPRET_SELECT_BLOCK if interpreting() else _GPU_SELECT_BLOCK))
    n_chunks = cdiv(max_entries, block)
    counts = torch.empty(tokens, 2 * n_chunks, dtype=torch.int32, device=q.device)
    block_k = max(16, min(next_power_of_2(k), _MAX_BLOCK_K))
    _indexer_count_kernel[(tokens, n_chunks)](
        scores, top, counts,
        max_entries, k,
        scores.stride(0), top.stride(0), counts.stride(0),
        BLOCK=block, BLOCK_K=block_k,
        num_warps=4,
    )
    out = torch.empty(tokens, top_k, dtype=torch.int32, device=q.device)
    _indexer_select_kernel[(tokens, n_chunks)](
        scores, top, counts, out,
        max_entries, k, top_k, n_chunks,
        scores.stride(0), top.stride(0), counts.stride(0), out.stride(0),
        BLOCK=block, BLOCK_K=block_k, BLOCK_C=max(2, next_power_of_2(n_chunks)),
        num_warps=4,
    )
    return out


@lru_cache(maxsize=None)
def _invariant_reference():
    from deepinfer.exact_order import invariant

    return invariant(_reference)


REGISTRATIONS = [
    Registration(
        op="indexer_topk",
        fn=indexer_topk,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        note="Triton: heads x entries tensor-core scores, torch.topk threshold + ordered tie-rule select",
    ),
    Registration(
        op="indexer_topk",
        fn=indexer_topk_invariant,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        priority=-1,
        batch_invariant=True,
        note="Triton: heads x entries tensor-core scores, torch.topk threshold + ordered tie-rule select; the GPU's entry tile under the interpreter too",
    ),
]
