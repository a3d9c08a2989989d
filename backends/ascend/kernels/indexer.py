"""Ascend Triton kernels: indexer_topk (DeepSeek-V4's Lightning Indexer: each query's top_k compressed entries).

score(t, e) = sum_h w[t, h] * relu(q[t, h] . keys[entry_rows[seq(t), e]]) over the entries
e < num_visible[t], w = float32(weights) * weights_scale (weights loaded in their dtype, the
projection's bfloat16 say, converted and scaled in the kernel: the model's own product, bit for bit);
the result is the rows entry_rows[seq(t), e] of the top_k entries e by score, equal scores lowest id
first, -1 past the visible ones (deepinfer.ops.indexer.indexer_topk). Two steps, no host synchronisation:

Scores (`_indexer_scores_kernel`): persistent cube grid, `cube_grid(items)` programs over
(query, entry block) items, entry block fastest (the blocks of one query run on neighbouring
cores: its q rows and the sequence's keys are shared through L2). An item is one cube product with
the query's heads as M and the gathered key rows as N: logits[H, BLOCK_E] = q[t] [H, D] @
keys^T [D, BLOCK_E] (D in chunks of at most 128 accumulated in a fixed order, float32
accumulation, "ieee" for float32 operands), then on the vector side relu, times weights[t, h] and
a sum over the heads; only the float32 score is written: scores [T, E] (rows padded to 32 bytes),
for the entries t sees. A block wholly past num_visible[t] loads and writes nothing.
Heads and D are padded to 16 with zeros (relu(0) * 0 adds exactly 0).

Selection (`_indexer_select_kernel`, vector items over (query, chunk), as the cuda backend's):
a chunk's visible scores as int32 order keys, the k-th largest key found exactly bit by bit (32
counts), then the reference's rule (`_top_ids_lowest_first`: every key above it, then the first
k - #(above) keys equal to a finite k-th in id order; deepinfer.triton_common.top_k_lowest_first),
stored compacted in ascending id order. A row wider than a chunk keeps each chunk's top k as
candidates (order keys and ids, in id order) and selects again over them, launch after launch,
until one chunk holds the row: the last writes the entries' rows, -1 after the last. Only the
entries below num_visible are scored or read (a decode plan's tables are E_max wide; torch.topk,
which this replaces, ran over the whole [T, E] width, -inf padding included).

FP8 keys (deepinfer.ops.kv_cache_format: D e4m3 bytes, then the key's float32 scale; an FP8
cache's indexer pool): the kernel takes the pool's bytes and the same memory as float32
(`fp8_views`; key row i's scale at float32 index (i * row stride + D) / 4). Each gathered key chunk
is decoded by integer arithmetic (`deepinfer.triton_common.e4m3_bits_to_f32`: A2/A3 have no
float8 type) exactly to q's dtype, and each key's scale multiplies its score after the head sum
(relu(s * x) = s * relu(x) for the scale s > 0).

Buffer budget (half the unified buffer): scores item: q chunk [BLOCK_H, BLOCK_D] + key chunk
[BLOCK_D, BLOCK_E] in the dot dtype + logits and their weighted relu, [BLOCK_H, BLOCK_E] float32
each; BLOCK_E is the largest power of two <= 128 that fits (bf16, 64 heads of 128: 64 on A2/A3,
128 on 950). FP8 keys add the decode of the key chunk, 13 bytes per element (its bytes, two int32
temporaries, the float32 values), so D is cut into smaller chunks instead of narrowing BLOCK_E:
bf16, 64 heads: A2/A3 BLOCK_E 64 x BLOCK_D 32 -> 66 KB; 950 BLOCK_E 128 x BLOCK_D 32 -> 128 KB.
Selection: about 10 live [CHUNK] 4-byte vectors (keys, masks, the prefix sum, ranks, ids): 40
bytes per element (2048-entry chunks on A2/A3 and 950; at least 2 * top_k).

Index arithmetic is int32; IDX64 switches the key-row and score offsets to int64 when the key pool
or the scores have >= 2^31 elements. float64 inputs (a test dtype) go to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops import kv_cache_format
from deepinfer.ops.indexer import check_indexer_topk_shapes
from deepinfer.ops.indexer import indexer_topk as _reference
from deepinfer.triton_common import (
    cdiv,
    e4m3_bits_to_f32,
    fp8_views,
    last_dim_contiguous,
    next_power_of_2,
    pad_selection,
    selection_chunk,
    store_candidates,
    top_k_lowest_first,
    upcast_dot,
)
from deepinfer_ascend.kernels.common import Registration, aligned, cube_grid, current, dot_precision, launch_options, tile_elems, vector_grid

INT32_LIMIT = 2**31
_MAX_BLOCK_D = 128  # D chunk of one tl.dot
_MAX_BLOCK_E = 128  # entries per scoring item
_SELECT_BYTES_PER_ELEM = 40
_MAX_SELECT_BLOCK = 4096
_MAX_BLOCK_K = 1024  # top-k values read per step
_FP8_DECODE_BYTES = 13  # live bytes per decoded key element: the e4m3 byte, two int32 temporaries, the float32 value


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, keys_ptr, key_scale_ptr, rows_ptr, seq_ptr, nv_ptr, scores_ptr,
    T, E, H, D, e_blocks, w_scale,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_k, stride_rb, stride_s,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IDX64: tl.constexpr,
    FP8: tl.constexpr,  # FP8 keys: keys_ptr their bytes, key_scale_ptr the same memory as float32
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    arange_e = tl.arange(0, BLOCK_E)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < H
    for item in range(pid, T * e_blocks, nprog):
        t = item // e_blocks
        first = (item % e_blocks) * BLOCK_E
        offs_e = first + arange_e
        nv = tl.minimum(tl.maximum(tl.load(nv_ptr + t).to(tl.int32), 0), E)
        if IDX64:
            dst = scores_ptr + t.to(tl.int64) * stride_s + offs_e
        else:
            dst = scores_ptr + t * stride_s + offs_e
        if first < nv:
            vis = offs_e < nv
            seq = tl.load(seq_ptr + t).to(tl.int32)
            rows = tl.maximum(tl.load(rows_ptr + seq * stride_rb + offs_e, mask=vis, other=0).to(tl.int32), 0)
            if IDX64:
                k_off = rows.to(tl.int64) * stride_k
            else:
                k_off = rows * stride_k
            k_rows = keys_ptr + k_off
            q_rows = q_ptr + t * stride_qt + offs_h * stride_qh
            logits = tl.zeros([BLOCK_H, BLOCK_E], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                d = d0 + offs_d
                d_ok = d < D
                q = tl.load(q_rows[:, None] + d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
                kt = tl.load(k_rows[None, :] + d[:, None], mask=d_ok[:, None] & vis[None, :], other=0.0)  # [BLOCK_D, BLOCK_E]
                if DOT_F32:
                    q = q.to(tl.float32)
                if FP8:  # e4m3 bytes -> q's dtype, exact (the key's scale is applied to its score)
                    kt = e4m3_bits_to_f32(kt.to(tl.int32)).to(q.dtype)
                elif DOT_F32:
                    kt = kt.to(tl.float32)
                logits = tl.dot(q, kt, logits, input_precision=DOT_PRECISION)
            w = tl.load(w_ptr + t * stride_wt + offs_h * stride_wh, mask=h_ok, other=0.0).to(tl.float32) * w_scale
            score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0)
            if FP8:  # relu(s * x) = s * relu(x) for the key's scale s > 0
                score = score * tl.load(key_scale_ptr + (k_off + D) // 4, mask=vis, other=0.0)
            tl.store(dst, score, mask=vis)  # (nothing past num_visible: the selection never reads it)


@triton.jit
def _indexer_select_kernel(
    src_ptr, src_ids_ptr, nv_ptr, dst_ptr, dst_ids_ptr, rows_ptr, seq_ptr,
    T, n_chunks, width, TOP_K,
    stride_src, stride_dst, stride_rb,
    CHUNK: tl.constexpr,
    FIRST: tl.constexpr,  # src: the float32 scores (ids: their columns, valid below num_visible); else candidate keys and ids
    LAST: tl.constexpr,  # write the row's entry rows (dst_ids [T, TOP_K], -1 after the last); else this chunk's candidates
    ROWS: tl.constexpr,  # LAST writes entry_rows[token_seq[t], id] (rows_ptr, seq_ptr); else the ids themselves
    BLOCK_K: tl.constexpr,
    IDX64: tl.constexpr,
):
    """Per (query, chunk of CHUNK entries) item: the chunk's top TOP_K by (score, then lowest id), in
    id order (deepinfer.triton_common.top_k_lowest_first). LAST (one chunk holds the row): the row's
    selection, as entry rows. Otherwise the chunk's candidates (order keys and ids at
    dst[t, c * TOP_K:], ORDER_KEY_NONE / -1 after them), which hold every entry the row takes from
    the chunk, in id order chunk after chunk."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for item in range(pid, T * n_chunks, nprog):
        t = item // n_chunks
        c = item % n_chunks
        if IDX64:
            t = t.to(tl.int64)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        keys, ids = selection_chunk(src_ptr, src_ids_ptr, nv_ptr, t, offs, width, stride_src, FIRST)
        take, pos, taken = top_k_lowest_first(keys, TOP_K)
        if LAST:
            out_row = dst_ids_ptr + t * stride_dst
            if ROWS:
                table_row = rows_ptr + tl.load(seq_ptr + t) * stride_rb
                tl.store(out_row + pos, tl.load(table_row + ids, mask=take, other=-1), mask=take)
            else:
                tl.store(out_row + pos, ids, mask=take)
            pad_selection(out_row, out_row, taken, TOP_K, BLOCK_K, False)
        else:
            out_row = dst_ids_ptr + t * stride_dst + c * TOP_K
            key_row = dst_ptr + t * stride_dst + c * TOP_K
            store_candidates(key_row, out_row, keys, ids, take, pos)
            pad_selection(key_row, out_row, taken, TOP_K, BLOCK_K, True)


def _score_bytes(block_h: int, block_d: int, block_e: int, e_dot: int, fp8: bool) -> int:
    """On-chip bytes of a scoring item's live tiles (see the module docstring)."""
    e_key = e_dot + (_FP8_DECODE_BYTES if fp8 else 0)
    return block_h * block_d * e_dot + block_d * block_e * e_key + 2 * block_h * block_e * 4


def _score_blocks(block_h: int, dim: int, e_dot: int, fp8: bool = False) -> tuple[int, int]:
    """(BLOCK_E, BLOCK_D): the largest power-of-two entry block <= _MAX_BLOCK_E whose scoring tiles
    fit half the buffer, BLOCK_D = min(next_pow2(D), 128); FP8 keys try narrower D chunks (>= 32)
    before a narrower entry block."""
    budget = current().ub_bytes // 2
    top_d = max(16, min(next_power_of_2(dim), _MAX_BLOCK_D))
    widths = [d for d in (128, 64, 32) if d <= top_d] if fp8 and top_d >= 32 else [top_d]
    block_e = _MAX_BLOCK_E
    while block_e > (32 if fp8 else 16):
        for block_d in widths:
            if _score_bytes(block_h, block_d, block_e, e_dot, fp8) <= budget:
                return block_e, block_d
        block_e //= 2
    return block_e, widths[-1]


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
    check_indexer_topk_shapes(q, weights, index_keys, entry_rows, token_seq, num_visible)
    if q.dtype == torch.float64 or index_keys.dtype == torch.float64:
        return _reference(q, weights, index_keys, entry_rows, token_seq, num_visible, top_k=top_k, weights_scale=weights_scale)
    tokens, heads, dim = q.shape
    max_entries = entry_rows.shape[1]
    k = min(top_k, max_entries)
    if tokens == 0 or k <= 0:
        return torch.full((tokens, top_k), -1, dtype=torch.int32, device=q.device)
    q, index_keys, entry_rows = last_dim_contiguous(q, index_keys, entry_rows)
    token_seq = token_seq.contiguous()
    num_visible = num_visible.contiguous()
    scores, idx64 = score_entries(q, weights, index_keys, entry_rows, token_seq, num_visible, weights_scale)
    return select(scores, num_visible, top_k, entry_rows, token_seq, idx64)


def score_entries(q, weights, index_keys, entry_rows, token_seq, num_visible, weights_scale: float = 1.0) -> tuple[torch.Tensor, bool]:
    """([T, E] float32 scores of each query's visible entries (`_indexer_scores_kernel`; columns at or
    past num_visible[t] are not written; rows padded to 32 bytes; weights taken as float32(weights) *
    weights_scale), whether offsets need int64).
    q, index_keys, entry_rows last-dim contiguous; token_seq, num_visible contiguous; not float64.
    The V4.1 candidate kernels score with it too."""
    tokens, heads, dim = q.shape
    max_entries = entry_rows.shape[1]
    row_stride = aligned(max_entries, torch.float32)
    scores = torch.empty(tokens, row_stride, dtype=torch.float32, device=q.device)[:, :max_entries]
    fp8 = kv_cache_format.is_fp8(index_keys)
    keys, key_scales = fp8_views(index_keys) if fp8 else (index_keys, index_keys)  # (key_scales: unused without FP8)
    # (FP8 keys decode to q's dtype exactly)
    dot_f32 = q.dtype == torch.float32 or (not fp8 and (index_keys.dtype == torch.float32 or q.dtype != index_keys.dtype))
    block_h = max(16, next_power_of_2(heads))
    block_e, block_d = _score_blocks(block_h, dim, 4 if dot_f32 else q.element_size(), fp8)
    e_blocks = cdiv(max_entries, block_e)
    idx64 = max(tokens * row_stride, keys.shape[0] * keys.stride(0) + keys.shape[1]) >= INT32_LIMIT
    _indexer_scores_kernel[(cube_grid(tokens * e_blocks),)](
        q, weights, keys, key_scales, entry_rows, token_seq, num_visible, scores,
        tokens, max_entries, heads, dim, e_blocks, float(weights_scale),
        q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), keys.stride(0), entry_rows.stride(0), scores.stride(0),
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_E=block_e,
        DOT_F32=dot_f32 or upcast_dot(),
        DOT_PRECISION=dot_precision(dot_f32 or upcast_dot()),
        IDX64=idx64,
        FP8=fp8,
        **launch_options(),
    )
    return scores, idx64


def select(scores, num_visible, top_k: int, entry_rows, token_seq, idx64: bool) -> torch.Tensor:
    """[T, top_k] int32 entry rows of each query's selection: `_indexer_select_kernel` over chunks of
    the row, then over the chunks' candidates, until one chunk holds them (each launch keeps at most
    half of its input). entry_rows None: the selected columns themselves (ascending, -1 after them)."""
    tokens = scores.shape[0]
    width = scores.shape[1]
    cap = max(min(tile_elems(_SELECT_BYTES_PER_ELEM), _MAX_SELECT_BLOCK), 2 * next_power_of_2(top_k))
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
            dst = torch.empty(tokens, aligned(n_chunks * top_k, torch.int32), dtype=torch.int32, device=scores.device)
            dst_ids = torch.empty_like(dst)
        _indexer_select_kernel[(vector_grid(tokens * n_chunks),)](
            src, src_ids, num_visible, dst, dst_ids, dst if entry_rows is None else entry_rows, dst if token_seq is None else token_seq,
            tokens, n_chunks, width, top_k,
            src.stride(0), dst.stride(0), 0 if entry_rows is None else entry_rows.stride(0),
            CHUNK=block, FIRST=first, LAST=last, ROWS=entry_rows is not None, BLOCK_K=block_k, IDX64=idx64 or tokens * dst.stride(0) >= INT32_LIMIT,
            **launch_options(),
        )
        if last:
            return dst_ids
        src, src_ids, width, first = dst, dst_ids, n_chunks * top_k, False


REGISTRATIONS = [
    # Invariant as it is: a score is one (query, entry block) item with tiles from heads, D and the chip; the selection
    # compares scores with the k-th largest one (an exact value), so entries past a query's own (padding) change nothing.
    Registration(
        op="indexer_topk",
        fn=indexer_topk,
        batch_invariant=True,
        note="Triton (ascend): persistent cube grid of heads x entries scores over the visible entries, exact k-th order key + ordered tie-rule select; "
        "FP8 keys decoded by integer e4m3, key scales on the scores",
    ),
]
