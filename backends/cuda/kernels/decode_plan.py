"""Triton kernel: decode_plan (DeepSeek-V4's decode-step plan, deepinfer/ops/decode_plan.py) in one launch.

The torch plan was ~50 launches of 2-4 us each in a decode step's graph; this is one. Program (b, c) of a
(B, chunks) grid writes chunk c of row b's tables laid end to end: its window rows, then each ratio's entry
table, every table starting at a chunk boundary so that a program writes one table (BLOCK columns of it).
The programs of chunk 0 also write their row's scalars: its position, token_seq, each ratio's visible count
and each compressor kind's five ring-plan entries; program (0, 0) writes group_rows. The ratios and kinds
are constexpr tuples (a model's set, compiled once): the ratio, ring and layout divisions are by constants.

The arithmetic is the reference's, in its widths: window slots in int64 (page * block_size + offset) then
int32, entry rows in int32 (page * rows + e % rows), ring plans in int64; every index it divides is
non-negative where its result is kept (a padding row is planned at position 0, a ring plan's window only
where one closes), so Triton's truncating division and remainder agree with torch's flooring ones.
Each row's tables are its own: batch-invariant as it is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.decode_plan import check_decode_plan_args, empty_outputs, entry_widths, rows_per_block
from deepinfer.triton_common import cdiv
from deepinfer_cuda.kernels.common import Registration, pdl_launch, pdl_prologue

_BLOCK = 1024  # table entries per program: a 1M-token context's ratio-4 table (262,144 entries a row) is 256 programs a row
_WARPS = 4


@triton.jit
def _decode_plan_kernel(
    positions_ptr, tables_ptr, slot_mapping_ptr, state_slots_ptr,
    positions_out, token_seq_out, window_out, entries_out, visible_out,
    ring_rows_out, window_starts_out, prev_starts_out, entry_positions_out, pool_rows_out, group_rows_out,
    B, W, stride_tables, groups,
    BLOCK_SIZE: tl.constexpr, WINDOW: tl.constexpr,
    RATIOS: tl.constexpr, ENTRY_ROWS: tl.constexpr, ENTRY_STRIDES: tl.constexpr,  # per ratio: its entries per block, blocks per entry
    KIND_RATIOS: tl.constexpr, KIND_OVERLAPS: tl.constexpr, KIND_RINGS: tl.constexpr, KIND_POOL_ROWS: tl.constexpr,  # per compressor kind
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    table_row = tables_ptr + b.to(tl.int64) * stride_tables
    slot = tl.load(slot_mapping_ptr + b)
    live = slot >= 0
    pos = tl.where(live, tl.load(positions_ptr + b), 0)  # a padding row's position is stale: planned at 0
    # (vector masks: a scalar broadcast with `&` upsets the interpreter)
    live_v = (offs * 0 + slot) >= 0

    window_chunks: tl.constexpr = (WINDOW + BLOCK - 1) // BLOCK
    if chunk < window_chunks:  # the sliding window: slots of positions p - WINDOW + 1 .. p
        j = chunk * BLOCK + offs
        q = pos - WINDOW + 1 + j
        at = tl.maximum(q, 0)
        col = at // BLOCK_SIZE
        page = tl.load(table_row + col, mask=(j < WINDOW) & (col < W), other=0).to(tl.int64)
        rows = tl.where((q >= 0) & live_v, page * BLOCK_SIZE + at % BLOCK_SIZE, -1)
        tl.store(window_out + b.to(tl.int64) * WINDOW + j, rows.to(tl.int32), mask=j < WINDOW)

    first_chunk = window_chunks  # each ratio's table starts at a chunk boundary
    table_start = b.to(tl.int64) * 0  # where ratio i's table [B, E_i] starts in entries_out
    for i in tl.static_range(len(RATIOS)):
        width = (W // ENTRY_STRIDES[i]) * ENTRY_ROWS[i]  # E_max: the entries the block tables hold
        entries = tl.where(live, (pos + 1) // RATIOS[i], 0)  # complete at the token
        local = chunk - first_chunk
        if (local >= 0) & (local * BLOCK < width):
            e = local * BLOCK + offs
            # Entry e lives in the block of its window's last token: ENTRY_ROWS to a block, or one every ENTRY_STRIDES blocks.
            col = (e // ENTRY_ROWS[i]) * ENTRY_STRIDES[i] + ENTRY_STRIDES[i] - 1
            page = tl.load(table_row + col, mask=e < width, other=0)
            rows = tl.where(e.to(tl.int64) < entries, page * ENTRY_ROWS[i] + e % ENTRY_ROWS[i], -1)
            tl.store(entries_out + table_start + b.to(tl.int64) * width + e, rows, mask=e < width)
        if chunk == 0:
            tl.store(visible_out + i * B + b, entries.to(tl.int32))
        first_chunk += (width + BLOCK - 1) // BLOCK
        table_start += width * B

    if chunk == 0:
        tl.store(positions_out + b, pos)
        tl.store(token_seq_out + b, b)
        state = tl.load(state_slots_ptr + b).to(tl.int64)
        with_state = live & (state >= 0)
        for k in tl.static_range(len(KIND_RATIOS)):
            base = tl.maximum(state, 0) * KIND_RINGS[k]
            closes = with_state & ((pos + 1) % KIND_RATIOS[k] == 0)
            first = pos + 1 - KIND_RATIOS[k]  # the closing window's first position
            at = k * B + b
            tl.store(ring_rows_out + at, tl.where(with_state, base + pos % KIND_RINGS[k], -1))
            tl.store(window_starts_out + at, tl.where(closes, base + first % KIND_RINGS[k], -1))
            if KIND_OVERLAPS[k]:
                tl.store(prev_starts_out + at, tl.where(closes & (first > 0), base + (first - KIND_RATIOS[k]) % KIND_RINGS[k], -1))
            else:
                tl.store(prev_starts_out + at, pos * 0 - 1)
            tl.store(entry_positions_out + at, tl.where(closes, first, 0))
            # The entry lives in the block of its window's last token: this token's.
            pool_row = slot // BLOCK_SIZE * KIND_POOL_ROWS[k] + pos % BLOCK_SIZE // KIND_RATIOS[k]
            tl.store(pool_rows_out + at, tl.where(closes, pool_row, -1))
        if b == 0:
            for g in range(0, groups, BLOCK):
                tl.store(group_rows_out + g + offs, offs * 0 + B, mask=g + offs < groups)


def decode_plan(
    positions: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    state_slots: torch.Tensor,
    *,
    block_size: int,
    window: int,
    ratios: tuple[int, ...],
    rings: tuple[tuple[int, bool, int], ...],
    groups: int,
) -> tuple[torch.Tensor, ...]:
    check_decode_plan_args(positions, block_tables, slot_mapping, state_slots, block_size, window, ratios, rings, groups)
    device, batch, width = positions.device, positions.shape[0], block_tables.shape[1]
    widths = entry_widths(block_size, width, ratios)
    out = empty_outputs(positions, block_tables, block_size=block_size, window=window, ratios=ratios, rings=rings, groups=groups)
    if batch == 0:  # no row, no program (empty_outputs made the counts 0)
        return tuple(out.values())
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    chunks = cdiv(window, _BLOCK) + sum(cdiv(w, _BLOCK) for w in widths)
    _decode_plan_kernel[(batch, max(chunks, 1))](
        positions.contiguous(), block_tables, slot_mapping.contiguous(), state_slots.contiguous(), *out.values(),
        batch, width, block_tables.stride(0), groups,
        BLOCK_SIZE=block_size, WINDOW=window,
        RATIOS=tuple(ratios), ENTRY_ROWS=tuple(rows_per_block(block_size, r) for r in ratios), ENTRY_STRIDES=tuple(max(1, r // block_size) for r in ratios),
        KIND_RATIOS=tuple(r for r, _, _ in rings), KIND_OVERLAPS=tuple(bool(o) for _, o, _ in rings), KIND_RINGS=tuple(n for _, _, n in rings),
        KIND_POOL_ROWS=tuple(rows_per_block(block_size, r) for r, _, _ in rings),
        BLOCK=_BLOCK, num_warps=_WARPS, **pdl_launch(device),
    )  # fmt: skip
    return tuple(out.values())


REGISTRATIONS = [
    Registration(
        op="decode_plan",
        fn=decode_plan,
        note="Triton: one launch, a program per (row, chunk of its tables); ratios and compressor kinds as constexprs",
        batch_invariant=True,  # each row's tables are its own
    )
]
