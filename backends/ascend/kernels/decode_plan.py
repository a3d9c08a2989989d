"""Ascend Triton kernel: decode_plan (DeepSeek-V4's decode-step plan, deepinfer/ops/decode_plan.py), one launch per ratio.

The torch plan was ~50 small launches a decode step. A launch here plans table j and compressor kind j of the op's
`ratios` and `rings` (the first launch also the window rows, positions, token_seq and group_rows): max(1, R, K)
launches, 2 for DeepSeek-V4 (its CSA and HCA ratios and kinds), where the cuda kernel takes one. Why not one:
the ratios and kinds are a launch's constants (divisions by constants, a kernel per model's set), and
triton-ascend's Triton (3.2) takes no tuple arguments to pass a list of them.

A vector kernel on a persistent grid (`vector_grid`): the programs share out, in turn, the window tiles (row,
chunk of BLOCK columns), the entry table's tiles and the row blocks whose scalars they write (each row's visible
count and the kind's five ring-plan entries). Index arithmetic is int32 (int64 is slow on the vector units):
positions, slots and state slots are int64 / int32 in memory and below 2^31 in value (a cache's slots, a model's
positions), so each table is the reference's bit for bit: the window slots the reference computes in int64 and
casts to int32 wrap alike in int32, entry rows are int32 in both, and the ring plans' values are stored as
int64. Every index it divides is non-negative where its result is kept (a padding row is planned at position 0,
a ring plan's window only where one closes), so Triton's truncating division and remainder agree with torch's
flooring ones. Buffer: a tile holds about six int32 temporaries per column (`tile_elems`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.decode_plan import check_decode_plan_args, empty_outputs, entry_widths, rows_per_block
from deepinfer.triton_common import cdiv
from deepinfer_ascend.kernels.common import Registration, launch_options, tile_elems, vector_grid

_BYTES_PER_ELEM = 24  # six int32 temporaries per column of a tile
_MAX_BLOCK = 1024
_ROW_BLOCK = 64  # rows per scalar tile


@triton.jit
def _decode_plan_kernel(
    positions_ptr, tables_ptr, slot_mapping_ptr, state_slots_ptr,
    positions_out, token_seq_out, window_out, entries_out, visible_out,
    ring_rows_out, window_starts_out, prev_starts_out, entry_positions_out, pool_rows_out, group_rows_out,
    B, W, stride_tables, groups, table_start, table, kind,
    BLOCK_SIZE: tl.constexpr,
    WINDOW: tl.constexpr,  # this launch's window columns (0: another launch writes them, with the rows' positions)
    RATIO: tl.constexpr, ENTRY_ROWS: tl.constexpr, ENTRY_STRIDE: tl.constexpr,  # this launch's entry table (RATIO 0: none)
    KIND_RATIO: tl.constexpr, KIND_OVERLAP: tl.constexpr, KIND_RING: tl.constexpr, KIND_POOL_ROWS: tl.constexpr,  # its kind (0: none)
    FIRST: tl.constexpr,  # also positions, token_seq and group_rows
    BLOCK: tl.constexpr, ROW_BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)

    if WINDOW > 0:  # the sliding window: slots of positions p - WINDOW + 1 .. p
        chunks = (WINDOW + BLOCK - 1) // BLOCK
        for t in range(pid, B * chunks, num_programs):
            b = t // chunks
            j = (t % chunks) * BLOCK + offs
            slot = tl.load(slot_mapping_ptr + b)
            pos = tl.where(slot >= 0, tl.load(positions_ptr + b), 0).to(tl.int32)  # a padding row's position is stale: planned at 0
            q = pos - WINDOW + 1 + j
            at = tl.maximum(q, 0)
            col = at // BLOCK_SIZE
            page = tl.load(tables_ptr + b.to(tl.int64) * stride_tables + col, mask=(j < WINDOW) & (col < W), other=0)
            live = (offs * 0 + slot.to(tl.int32)) >= 0  # (vector masks: a scalar broadcast with `&` upsets the interpreter)
            rows = tl.where((q >= 0) & live, page * BLOCK_SIZE + at % BLOCK_SIZE, -1)
            tl.store(window_out + b.to(tl.int64) * WINDOW + j, rows, mask=j < WINDOW)

    if RATIO > 0:  # the entry table: entry e in the block of its window's last token
        width = (W // ENTRY_STRIDE) * ENTRY_ROWS
        chunks = (width + BLOCK - 1) // BLOCK
        for t in range(pid, B * chunks, num_programs):
            b = t // chunks
            e = (t % chunks) * BLOCK + offs
            slot = tl.load(slot_mapping_ptr + b)
            pos = tl.where(slot >= 0, tl.load(positions_ptr + b), 0).to(tl.int32)
            entries = tl.where(slot >= 0, (pos + 1) // RATIO, 0)  # complete at the token
            col = (e // ENTRY_ROWS) * ENTRY_STRIDE + ENTRY_STRIDE - 1
            page = tl.load(tables_ptr + b.to(tl.int64) * stride_tables + col, mask=e < width, other=0)
            rows = tl.where(e < entries, page * ENTRY_ROWS + e % ENTRY_ROWS, -1)
            tl.store(entries_out + table_start + b.to(tl.int64) * width + e, rows, mask=e < width)

    rows_b = tl.arange(0, ROW_BLOCK)
    for t in range(pid, (B + ROW_BLOCK - 1) // ROW_BLOCK, num_programs):  # each row's scalars
        b = t * ROW_BLOCK + rows_b
        ok = b < B
        slot = tl.load(slot_mapping_ptr + b, mask=ok, other=-1)
        live = slot >= 0
        pos = tl.where(live, tl.load(positions_ptr + b, mask=ok, other=0), 0).to(tl.int32)
        if FIRST:
            tl.store(positions_out + b, pos.to(tl.int64), mask=ok)
            tl.store(token_seq_out + b, b, mask=ok)
        if RATIO > 0:
            tl.store(visible_out + table * B + b, tl.where(live, (pos + 1) // RATIO, 0), mask=ok)
        if KIND_RATIO > 0:
            state = tl.load(state_slots_ptr + b, mask=ok, other=-1)
            with_state = live & (state >= 0)
            base = tl.maximum(state, 0) * KIND_RING
            closes = with_state & ((pos + 1) % KIND_RATIO == 0)
            first = pos + 1 - KIND_RATIO  # the closing window's first position
            at = kind * B + b
            tl.store(ring_rows_out + at, tl.where(with_state, base + pos % KIND_RING, -1).to(tl.int64), mask=ok)
            tl.store(window_starts_out + at, tl.where(closes, base + first % KIND_RING, -1).to(tl.int64), mask=ok)
            if KIND_OVERLAP:
                prev = tl.where(closes & (first > 0), base + (first - KIND_RATIO) % KIND_RING, -1)
            else:
                prev = pos * 0 - 1
            tl.store(prev_starts_out + at, prev.to(tl.int64), mask=ok)
            tl.store(entry_positions_out + at, tl.where(closes, first, 0).to(tl.int64), mask=ok)
            # The entry lives in the block of its window's last token: this token's.
            pool_row = slot.to(tl.int32) // BLOCK_SIZE * KIND_POOL_ROWS + pos % BLOCK_SIZE // KIND_RATIO
            tl.store(pool_rows_out + at, tl.where(closes, pool_row, -1).to(tl.int64), mask=ok)

    if FIRST:
        if pid == 0:
            for g in range(0, groups, ROW_BLOCK):
                tl.store(group_rows_out + g + rows_b, rows_b * 0 + B, mask=g + rows_b < groups)


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
    batch, width = positions.shape[0], block_tables.shape[1]
    widths = entry_widths(block_size, width, ratios)
    out = empty_outputs(positions, block_tables, block_size=block_size, window=window, ratios=ratios, rings=rings, groups=groups)
    if batch == 0:  # no row, no program (empty_outputs made the counts 0)
        return tuple(out.values())
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    inputs = (positions.contiguous(), block_tables, slot_mapping.contiguous(), state_slots.contiguous())
    block = min(_MAX_BLOCK, tile_elems(_BYTES_PER_ELEM))
    table_start = 0
    for j in range(max(1, len(ratios), len(rings))):
        ratio = ratios[j] if j < len(ratios) else 0
        kind_ratio, overlap, ring = rings[j] if j < len(rings) else (0, False, 0)
        tiles = batch * (cdiv(window, block) * (j == 0) + (cdiv(widths[j], block) if ratio else 0)) + cdiv(batch, _ROW_BLOCK)
        _decode_plan_kernel[(vector_grid(tiles),)](
            *inputs, *out.values(),
            batch, width, block_tables.stride(0), groups, table_start, j, j,
            BLOCK_SIZE=block_size, WINDOW=window if j == 0 else 0,
            RATIO=ratio, ENTRY_ROWS=rows_per_block(block_size, ratio) if ratio else 1, ENTRY_STRIDE=max(1, ratio // block_size),
            KIND_RATIO=kind_ratio, KIND_OVERLAP=bool(overlap), KIND_RING=ring, KIND_POOL_ROWS=rows_per_block(block_size, kind_ratio) if kind_ratio else 1,
            FIRST=j == 0, BLOCK=block, ROW_BLOCK=_ROW_BLOCK, **launch_options(),
        )  # fmt: skip
        table_start += batch * widths[j] if ratio else 0
    return tuple(out.values())


REGISTRATIONS = [
    Registration(
        op="decode_plan",
        fn=decode_plan,
        note="Triton (ascend): a launch per ratio (table and compressor kind), persistent vector grid, int32 index arithmetic",
        batch_invariant=True,  # each row's tables are its own
    )
]
