"""Ascend Triton kernels: indexer_topk (DeepSeek-V4's Lightning Indexer: each query's top_k compressed entries).

score(t, e) = sum_h weights[t, h] * relu(q[t, h] . keys[entry_rows[seq(t), e]]) over the entries
e < num_visible[t]; the result is the rows entry_rows[seq(t), e] of the top_k entries e by score,
equal scores lowest id first, -1 past the visible ones (deepinfer.ops.indexer.indexer_topk). Two steps, no host synchronisation:

Scores (`_indexer_scores_kernel`): persistent cube grid, `cube_grid(items)` programs over
(query, entry block) items, entry block fastest (the blocks of one query run on neighbouring
cores: its q rows and the sequence's keys are shared through L2). An item is one cube product with
the query's heads as M and the gathered key rows as N: logits[H, BLOCK_E] = q[t] [H, D] @
keys^T [D, BLOCK_E] (D in chunks of at most 128 accumulated in a fixed order, float32
accumulation, "ieee" for float32 operands), then on the vector side relu, times weights[t, h] and
a sum over the heads; only the float32 score is written: scores [T, E] (rows padded to 32 bytes),
-inf for entries t does not see. A block wholly past num_visible[t] writes -inf without loading.
Heads and D are padded to 16 with zeros (relu(0) * 0 adds exactly 0).

Selection: torch.topk(scores, k, sorted=False) (torch_npu's, on the device) gives the k-th
largest score kth (the minimum of the returned values, an element's exact value), then two vector
kernels, each `vector_grid(items)` programs looping over (query, chunk of BLOCK entries) items,
apply the reference's rule (`_top_ids_lowest_first`): every score > kth is taken, and the first
room = k - #(topk values > kth) finite scores == kth in id order. `_indexer_count_kernel` counts
each chunk's scores > kth and == kth; `_indexer_select_kernel` sums the counts of the chunks
before its own (the ids taken before it: above + min(ties, room)), ranks its ties and its taken
ids with tl.cumsum and stores the taken ids' entry rows at their ranks: each row comes out compacted
in ascending id order (as the reference's does), -1 after the last (written by chunk 0's item).
Chunks rather than one item per query: a decode step has few queries over up to 256k entries, and
every vector core takes part. torch glue rather than an in-kernel radix select: topk is one tuned
library call, and since kth is an element's exact value the tie rule is reproduced bit for bit by
comparisons alone; an in-kernel select would need per-query digit histograms (atomics, several
passes) or ~32 bisection passes over rows of up to 256k entries on the vector cores.

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
Selection: about 10 live [BLOCK] 4-byte vectors (scores, masks, two prefix sums,
positions, ids): 40 bytes per element (2048-entry chunks on A2/A3 and 950).

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
from deepinfer.triton_common import cdiv, e4m3_bits_to_f32, fp8_views, last_dim_contiguous, next_power_of_2, upcast_dot
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
    T, E, H, D, e_blocks,
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
            w = tl.load(w_ptr + t * stride_wt + offs_h * stride_wh, mask=h_ok, other=0.0).to(tl.float32)
            score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0)
            if FP8:  # relu(s * x) = s * relu(x) for the key's scale s > 0
                score = score * tl.load(key_scale_ptr + (k_off + D) // 4, mask=vis, other=0.0)
            tl.store(dst, tl.where(vis, score, float("-inf")), mask=offs_e < E)
        else:
            tl.store(dst, tl.full([BLOCK_E], float("-inf"), tl.float32), mask=offs_e < E)


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
    T, E, K, n_chunks,
    stride_s, stride_v, stride_c,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IDX64: tl.constexpr,
):
    """Per (query, chunk of BLOCK entries) item: how many scores are > kth and how many equal it (finite)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    for item in range(pid, T * n_chunks, nprog):
        t = item // n_chunks
        c = item % n_chunks
        kth, room = _kth_and_room(topv_ptr, t, K, stride_v, BLOCK_K)
        e = c * BLOCK + offs
        if IDX64:
            row = scores_ptr + t.to(tl.int64) * stride_s
        else:
            row = scores_ptr + t * stride_s
        s = tl.load(row + e, mask=e < E, other=float("-inf"))
        above = tl.sum((s > kth).to(tl.int32), axis=0)
        tied = tl.sum(((s == kth) & (s > float("-inf")) & (s < float("inf"))).to(tl.int32), axis=0)
        tl.store(counts_ptr + t * stride_c + 2 * c, above)
        tl.store(counts_ptr + t * stride_c + 2 * c + 1, tied)


@triton.jit
def _indexer_select_kernel(
    scores_ptr, topv_ptr, counts_ptr, out_ptr, rows_ptr, seq_ptr,
    T, E, K, TOP_K, n_chunks,
    stride_s, stride_v, stride_c, stride_o, stride_rb,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    IDX64: tl.constexpr,
):
    """Per (query, chunk) item: the chunk's taken ids (every score > kth, and the ties while the
    first `room` ties of the row in id order last), as their entry rows at their ranks in the row's
    ascending id list."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    offs_c = tl.arange(0, BLOCK_C)
    for item in range(pid, T * n_chunks, nprog):
        t = item // n_chunks
        c = item % n_chunks
        kth, room = _kth_and_room(topv_ptr, t, K, stride_v, BLOCK_K)
        count_row = counts_ptr + t * stride_c + 2 * offs_c
        above_c = tl.load(count_row, mask=offs_c < n_chunks, other=0)
        tied_c = tl.load(count_row + 1, mask=offs_c < n_chunks, other=0)
        before = offs_c < c
        tied_before = tl.sum(tl.where(before, tied_c, 0), axis=0)
        taken_before = tl.sum(tl.where(before, above_c, 0), axis=0) + tl.minimum(tied_before, room)
        e = c * BLOCK + offs
        if IDX64:
            row = scores_ptr + t.to(tl.int64) * stride_s
        else:
            row = scores_ptr + t * stride_s
        s = tl.load(row + e, mask=e < E, other=float("-inf"))
        tied = ((s == kth) & (s > float("-inf")) & (s < float("inf"))).to(tl.int32)
        take = (s > kth) | ((tied != 0) & (tied_before + tl.cumsum(tied, axis=0) <= room))
        pos = taken_before + tl.cumsum(take.to(tl.int32), axis=0) - 1
        out_row = out_ptr + t * stride_o
        if IDX64:
            table_row = rows_ptr + tl.load(seq_ptr + t).to(tl.int64) * stride_rb
        else:
            table_row = rows_ptr + tl.load(seq_ptr + t) * stride_rb
        tl.store(out_row + pos, tl.load(table_row + e, mask=take, other=-1), mask=take)
        if c == 0:  # -1 after the row's last taken id
            taken = tl.sum(above_c, axis=0) + tl.minimum(tl.sum(tied_c, axis=0), room)
            for p0 in range(0, TOP_K, BLOCK_K):
                p = p0 + tl.arange(0, BLOCK_K)
                tl.store(out_row + p, tl.full([BLOCK_K], -1, tl.int32), mask=(p >= taken) & (p < TOP_K))


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
) -> torch.Tensor:
    check_indexer_topk_shapes(q, weights, index_keys, entry_rows, token_seq, num_visible)
    if q.dtype == torch.float64 or index_keys.dtype == torch.float64:
        return _reference(q, weights, index_keys, entry_rows, token_seq, num_visible, top_k=top_k)
    tokens, heads, dim = q.shape
    max_entries = entry_rows.shape[1]
    k = min(top_k, max_entries)
    if tokens == 0 or k <= 0:
        return torch.full((tokens, top_k), -1, dtype=torch.int32, device=q.device)
    q, index_keys, entry_rows = last_dim_contiguous(q, index_keys, entry_rows)
    token_seq = token_seq.contiguous()
    num_visible = num_visible.contiguous()

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
        tokens, max_entries, heads, dim, e_blocks,
        q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), keys.stride(0), entry_rows.stride(0), scores.stride(0),
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_E=block_e,
        DOT_F32=dot_f32 or upcast_dot(),
        DOT_PRECISION=dot_precision(dot_f32 or upcast_dot()),
        IDX64=idx64,
        FP8=fp8,
        **launch_options(),
    )

    top = torch.topk(scores, k, dim=1, sorted=False).values
    block = max(16, min(next_power_of_2(max_entries), tile_elems(_SELECT_BYTES_PER_ELEM), _MAX_SELECT_BLOCK))
    n_chunks = cdiv(max_entries, block)
    counts = torch.empty(tokens, aligned(2 * n_chunks, torch.int32), dtype=torch.int32, device=q.device)
    block_k = max(16, min(next_power_of_2(k), _MAX_BLOCK_K))
    items = tokens * n_chunks
    _indexer_count_kernel[(vector_grid(items),)](
        scores, top, counts,
        tokens, max_entries, k, n_chunks,
        scores.stride(0), top.stride(0), counts.stride(0),
        BLOCK=block, BLOCK_K=block_k, IDX64=idx64,
        **launch_options(),
    )
    out = torch.empty(tokens, top_k, dtype=torch.int32, device=q.device)
    _indexer_select_kernel[(vector_grid(items),)](
        scores, top, counts, out, entry_rows, token_seq,
        tokens, max_entries, k, top_k, n_chunks,
        scores.stride(0), top.stride(0), counts.stride(0), out.stride(0), entry_rows.stride(0),
        BLOCK=block, BLOCK_K=block_k, BLOCK_C=max(8, next_power_of_2(n_chunks)), IDX64=idx64,
        **launch_options(),
    )
    return out


REGISTRATIONS = [
    # Invariant as it is: a score is one (query, entry block) item with tiles from heads, D and the chip; the selection
    # compares scores with the k-th largest one (an exact value), so entries past a query's own (padding) change nothing.
    Registration(
        op="indexer_topk",
        fn=indexer_topk,
        batch_invariant=True,
        note="Triton (ascend): persistent cube grid of heads x entries scores, torch.topk threshold + ordered tie-rule select; "
        "FP8 keys decoded by integer e4m3, key scales on the scores",
    ),
]
