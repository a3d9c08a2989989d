"""Ascend Triton kernels: candidate_blocks and indexer_topk_in_blocks (DeepSeek-V4.1's hierarchical candidate selection).

Both score the entries as indexer_topk does (`deepinfer_ascend.kernels.indexer.score_entries`: float32
scores of each query's visible entries, the weights converted and scaled by weights_scale in its
kernel) and select with its exact top-k (`select`: the k-th largest order key found bit by bit, ties
lowest id first), so their selections follow the reference's rules bit for bit on the same scores.
Each adds small vector kernels on persistent grids (`vector_grid`, every program looping over its
items):

candidate_blocks: the block of the query's newest visible entry (num_visible - 1) is always kept and
every block below it is wholly visible, so the kept set is that block plus the top_blocks - 1 best of
the blocks below it. `_block_scores_kernel` (items: query x tile of blocks) writes each of those
blocks' score (the max of its block_size entries) and how many there are; `select` picks the best
top_blocks - 1 of them (ids ascending, -1 after); `_append_newest_kernel` (items: queries) writes them
and the newest block after them (ascending still: it is the highest visible block).

indexer_topk_in_blocks: `_mark_blocks_kernel` (items: queries) sets a byte per (query, block) for the
listed blocks (ids outside 0 .. cdiv(E, block_size) - 1, the -1 padding included, match no block, as
in the reference); `_mask_outside_blocks_kernel` (items: query x entry tile) sets the visible entries
of unmarked blocks to -inf, which the selection never takes (finite scores only); `select` writes the
entry rows.

Buffer: the block tile is [BLOCK_B, next_pow2(block_size)] float32 (at most 4096 values, 16 KB); the
other tiles are 1024-wide int32 / float32 vectors. Index arithmetic is int32 (scores and marks of
2^31 elements or more go to the reference). Deviation: num_visible is clamped to E (as indexer_topk's
kernel does); the op's contract has num_visible <= E, and the reference, given more, would force no
block in candidate_blocks once the newest entry's block lies past the table. float64 (a test dtype)
goes to the reference. Batch-invariant as indexer_topk's kernels are: the added kernels work per
query, with tiles from block_size, top_blocks and the chip only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.candidates import candidate_blocks as _candidate_blocks_reference
from deepinfer.ops.candidates import indexer_topk_in_blocks as _in_blocks_reference
from deepinfer.ops.indexer import check_indexer_topk_shapes
from deepinfer.triton_common import cdiv, last_dim_contiguous, next_power_of_2
from deepinfer_ascend.kernels.common import Registration, aligned, launch_options, vector_grid
from deepinfer_ascend.kernels.indexer import score_entries, select

_INT32_LIMIT = 2**31
_BLOCK_TILE = 4096  # scores read per block-scoring item (blocks x block_size)
_MASK_TILE = 1024  # entries per masking item
_ROW_STEP = 1024  # block ids read per step of the per-query kernels


@triton.jit
def _block_scores_kernel(
    scores_ptr, nv_ptr, block_scores_ptr, below_ptr, T, E, b_tiles, stride_s, stride_b,
    BLOCK_SIZE: tl.constexpr, BS_PAD: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Scores of each query's blocks below its newest one (max of their entries) and their count (below[t])."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    j = tl.arange(0, BS_PAD)
    for item in range(pid, T * b_tiles, nprog):
        t = item // b_tiles
        tile = item % b_tiles
        b = tile * BLOCK_B + tl.arange(0, BLOCK_B)
        nv = tl.minimum(tl.maximum(tl.load(nv_ptr + t), 0), E)
        below = tl.maximum(nv - 1, 0) // BLOCK_SIZE  # the newest block's id: the count of blocks below it (0 when none is visible)
        if tile == 0:
            tl.store(below_ptr + t, below.to(tl.int32))
        ok = (b < below)[:, None] & (j < BLOCK_SIZE)[None, :]
        s = tl.load(scores_ptr + t * stride_s + b[:, None] * BLOCK_SIZE + j[None, :], mask=ok, other=float("-inf"))
        tl.store(block_scores_ptr + t * stride_b + b, tl.max(s, axis=1), mask=b < below)


@triton.jit
def _append_newest_kernel(
    sel_ptr, nv_ptr, out_ptr, T, E, n_sel, top_blocks, stride_sel, stride_out,
    BLOCK_SIZE: tl.constexpr, STEP: tl.constexpr,
):
    """out[t] = the selected blocks (ascending, -1 after them), then the newest visible block, then -1."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, STEP)
    for t in range(pid, T, nprog):
        nv = tl.minimum(tl.maximum(tl.load(nv_ptr + t), 0), E)
        newest = tl.where(nv > 0, (nv - 1) // BLOCK_SIZE, -1)
        count = 0
        for c0 in range(0, n_sel, STEP):
            count += tl.sum((tl.load(sel_ptr + t * stride_sel + c0 + offs, mask=c0 + offs < n_sel, other=-1) >= 0).to(tl.int32), axis=0)
        for c0 in range(0, top_blocks, STEP):
            c = c0 + offs
            chosen = tl.load(sel_ptr + t * stride_sel + c, mask=c < count, other=-1)
            tl.store(out_ptr + t * stride_out + c, tl.where(c == count, newest, chosen).to(tl.int32), mask=c < top_blocks)


@triton.jit
def _mark_blocks_kernel(blocks_ptr, marks_ptr, T, n_listed, n_blocks, stride_bl, stride_m, STEP: tl.constexpr):
    """marks[t, b] = 1 for each listed block id b of query t inside the table (equal stores: order-free)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, STEP)
    for t in range(pid, T, nprog):
        for c0 in range(0, n_listed, STEP):
            ids = tl.load(blocks_ptr + t * stride_bl + c0 + offs, mask=c0 + offs < n_listed, other=-1)
            ok = (ids >= 0) & (ids < n_blocks)
            tl.store(marks_ptr + t * stride_m + tl.where(ok, ids, 0), tl.full([STEP], 1, tl.int8), mask=ok)


@triton.jit
def _mask_outside_blocks_kernel(
    scores_ptr, marks_ptr, nv_ptr, T, E, e_tiles, stride_s, stride_m, BLOCK_SIZE: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Visible entries of each query whose block is not marked score -inf."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for item in range(pid, T * e_tiles, nprog):
        t = item // e_tiles
        e = (item % e_tiles) * BLOCK_E + tl.arange(0, BLOCK_E)
        vis = e < tl.minimum(tl.maximum(tl.load(nv_ptr + t), 0), E)
        marked = tl.load(marks_ptr + t * stride_m + e // BLOCK_SIZE, mask=vis, other=0) != 0
        tl.store(scores_ptr + t * stride_s + e, tl.full([BLOCK_E], float("-inf"), tl.float32), mask=vis & ~marked)


def _prepared(q, weights, index_keys, entry_rows, token_seq, num_visible):
    q, index_keys, entry_rows = last_dim_contiguous(q, index_keys, entry_rows)
    return q, weights, index_keys, entry_rows, token_seq.contiguous(), num_visible.contiguous()


def _too_large(tokens: int, entries: int) -> bool:
    """int32 offsets cover the scores and the marks."""
    return tokens * aligned(entries, torch.float32) >= _INT32_LIMIT


def candidate_blocks(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    entry_rows: torch.Tensor,
    token_seq: torch.Tensor,
    num_visible: torch.Tensor,
    *,
    block_size: int,
    top_blocks: int,
    weights_scale: float = 1.0,
) -> torch.Tensor:
    check_indexer_topk_shapes(q, weights, index_keys, entry_rows, token_seq, num_visible)
    if block_size < 1 or top_blocks < 1:
        raise ValueError(f"candidate_blocks wants block_size >= 1 and top_blocks >= 1, got {block_size} and {top_blocks}")
    tokens, entries = q.shape[0], entry_rows.shape[1]
    if q.dtype == torch.float64 or index_keys.dtype == torch.float64 or _too_large(tokens, entries):
        return _candidate_blocks_reference(q, weights, index_keys, entry_rows, token_seq, num_visible, block_size=block_size, top_blocks=top_blocks,
                                           weights_scale=weights_scale)  # fmt: skip
    out = torch.full((tokens, top_blocks), -1, dtype=torch.int32, device=q.device)
    if tokens == 0 or entries == 0:
        return out
    args = _prepared(q, weights, index_keys, entry_rows, token_seq, num_visible)
    num_visible = args[5]
    scores, idx64 = score_entries(*args, weights_scale)
    n_blocks = cdiv(entries, block_size)
    block_scores = torch.empty(tokens, aligned(n_blocks, torch.float32), dtype=torch.float32, device=q.device)[:, :n_blocks]
    below = torch.empty(tokens, dtype=torch.int32, device=q.device)
    bs_pad = next_power_of_2(block_size)
    block_b = max(1, min(next_power_of_2(n_blocks), _BLOCK_TILE // bs_pad))
    b_tiles = cdiv(n_blocks, block_b)
    _block_scores_kernel[(vector_grid(tokens * b_tiles),)](
        scores, num_visible, block_scores, below, tokens, entries, b_tiles, scores.stride(0), block_scores.stride(0),
        BLOCK_SIZE=block_size, BS_PAD=bs_pad, BLOCK_B=block_b, **launch_options(),
    )  # fmt: skip
    sel = select(block_scores, below, top_blocks - 1, None, None, idx64) if top_blocks > 1 else out  # (top_blocks 1: nothing selected)
    step = max(16, min(next_power_of_2(top_blocks), _ROW_STEP))
    _append_newest_kernel[(vector_grid(tokens),)](
        sel, num_visible, out, tokens, entries, top_blocks - 1, top_blocks, sel.stride(0), out.stride(0),
        BLOCK_SIZE=block_size, STEP=step, **launch_options(),
    )  # fmt: skip
    return out


def indexer_topk_in_blocks(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    entry_rows: torch.Tensor,
    token_seq: torch.Tensor,
    num_visible: torch.Tensor,
    blocks: torch.Tensor,
    *,
    top_k: int,
    block_size: int,
    weights_scale: float = 1.0,
) -> torch.Tensor:
    check_indexer_topk_shapes(q, weights, index_keys, entry_rows, token_seq, num_visible)
    if blocks.dim() != 2 or blocks.shape[0] != q.shape[0]:
        raise ValueError(f"blocks must be [T={q.shape[0]}, NB], got {tuple(blocks.shape)}")
    tokens, entries = q.shape[0], entry_rows.shape[1]
    if q.dtype == torch.float64 or index_keys.dtype == torch.float64 or _too_large(tokens, entries):
        return _in_blocks_reference(q, weights, index_keys, entry_rows, token_seq, num_visible, blocks, top_k=top_k, block_size=block_size,
                                    weights_scale=weights_scale)  # fmt: skip
    if tokens == 0 or entries == 0 or min(top_k, entries) <= 0:
        return torch.full((tokens, top_k), -1, dtype=torch.int32, device=q.device)
    args = _prepared(q, weights, index_keys, entry_rows, token_seq, num_visible)
    _, _, _, entry_rows, token_seq, num_visible = args
    scores, idx64 = score_entries(*args, weights_scale)
    n_blocks = cdiv(entries, block_size)
    marks = torch.zeros(tokens, aligned(n_blocks, torch.int8), dtype=torch.int8, device=q.device)
    blocks = blocks.contiguous()
    if blocks.shape[1]:
        step = max(16, min(next_power_of_2(blocks.shape[1]), _ROW_STEP))
        _mark_blocks_kernel[(vector_grid(tokens),)](
            blocks, marks, tokens, blocks.shape[1], n_blocks, blocks.stride(0), marks.stride(0), STEP=step, **launch_options(),
        )  # fmt: skip
    block_e = max(16, min(next_power_of_2(entries), _MASK_TILE))
    e_tiles = cdiv(entries, block_e)
    _mask_outside_blocks_kernel[(vector_grid(tokens * e_tiles),)](
        scores, marks, num_visible, tokens, entries, e_tiles, scores.stride(0), marks.stride(0),
        BLOCK_SIZE=block_size, BLOCK_E=block_e, **launch_options(),
    )  # fmt: skip
    return select(scores, num_visible, top_k, entry_rows, token_seq, idx64)


REGISTRATIONS = [
    Registration(
        op="candidate_blocks",
        fn=candidate_blocks,
        batch_invariant=True,
        note="Triton (ascend): indexer scores, block maxima below the newest block, exact top-k select of top_blocks - 1, newest block appended",
    ),
    Registration(
        op="indexer_topk_in_blocks",
        fn=indexer_topk_in_blocks,
        batch_invariant=True,
        note="Triton (ascend): indexer scores, entries outside the listed blocks masked to -inf, exact top-k select",
    ),
]
