"""DeepSeek-V4's decode-step plan as one op: every cache row a decode step reads and writes, from the batch's device tensors.

A decode step (one token per sequence) needs no host fact to find its rows: its sliding window's cache
slots, each compression ratio's entry table and each compressor kind's ring plan follow from the
token's position, its sequence's block table, its cache slot and its state slot by integer arithmetic
(deepinfer.model.deepseek_v4.decode_plan fills the model's plan from these tables and says what each
means to the layers). As torch code that arithmetic was ~50 small launches per step; as an op a backend
computes every table in one kernel, and the whole plan is still part of the step a device graph captures.

The caches' layout the tables follow (deepinfer.model.deepseek_v4.caches): a sliding-window slot is
page * block_size + position % block_size; a ratio's compressed entries are paged with the tokens,
`rows_per_block` = max(1, block_size // ratio) of them to a block, entry e in the block of its window's
last token (with ratio > block size, one entry in every (ratio // block_size)-th block of the table);
a compressor kind's ring holds `ring` rows per state slot, position p in row p % ring.
"""

from __future__ import annotations

import torch

from deepinfer.ops.sparse_attention import V4_AND_V41
from deepinfer.registry import EXACT, op

I32 = torch.int32

RING_FIELDS = ("ring_rows", "window_starts", "prev_starts", "entry_positions", "pool_rows")  # per compressor kind, [K, B] int64 each
OUTPUTS = ("positions", "token_seq", "window_rows", "entry_rows", "num_visible", *RING_FIELDS, "group_rows")


def rows_per_block(block_size: int, ratio: int) -> int:
    """Compressed entries of ratio `ratio` per KV block: max(1, block_size // ratio); the two must divide one another."""
    if block_size % ratio and ratio % block_size:
        raise ValueError(f"the KV block size {block_size} and the compression ratio {ratio} must divide one another")
    return max(1, block_size // ratio)


def entry_widths(block_size: int, table_width: int, ratios: tuple[int, ...]) -> list[int]:
    """E_max of each ratio: the entries block tables of `table_width` pages hold, table_width * block_size // ratio."""
    return [table_width * block_size // ratio for ratio in ratios]


def split_entry_rows(entry_rows: torch.Tensor, batch: int, block_size: int, table_width: int, ratios: tuple[int, ...]) -> list[torch.Tensor]:
    """`decode_plan`'s flat entry_rows as each ratio's [batch, E_max] table (contiguous views, no copy)."""
    tables, offset = [], 0
    for width in entry_widths(block_size, table_width, ratios):
        tables.append(entry_rows[offset : offset + batch * width].view(batch, width))
        offset += batch * width
    return tables


def empty_outputs(positions: torch.Tensor, block_tables: torch.Tensor, *, block_size: int, window: int, ratios: tuple[int, ...],
                  rings: tuple, groups: int) -> dict[str, torch.Tensor]:
    """The op's outputs, by name in OUTPUTS' order, allocated for a kernel to fill (the backends' shared allocation); for
    B = 0 already final: every table empty and the output projection's counts 0."""
    device, batch = positions.device, positions.shape[0]
    i32, i64 = torch.int32, torch.int64
    out = {
        "positions": torch.empty(batch, dtype=i64, device=device),
        "token_seq": torch.empty(batch, dtype=i32, device=device),
        "window_rows": torch.empty(batch, window, dtype=i32, device=device),
        "entry_rows": torch.empty(batch * sum(entry_widths(block_size, block_tables.shape[1], ratios)), dtype=i32, device=device),
        "num_visible": torch.empty(len(ratios), batch, dtype=i32, device=device),
        **{name: torch.empty(len(rings), batch, dtype=i64, device=device) for name in RING_FIELDS},
        "group_rows": torch.empty(groups, dtype=i32, device=device),
    }
    if batch == 0:
        out["group_rows"].zero_()
    return out


def check_decode_plan_args(positions, block_tables, slot_mapping, state_slots, block_size, window, ratios, rings, groups) -> None:
    """`decode_plan`'s shapes, dtypes and layout (no host synchronisation): every backend's check."""
    batch = positions.shape[0] if positions.dim() == 1 else -1
    if positions.dim() != 1 or slot_mapping.shape != (batch,) or state_slots.shape != (batch,) or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"decode_plan wants positions, slot_mapping and state_slots [B] and block_tables [B, W]; got {tuple(positions.shape)}, "
            f"{tuple(slot_mapping.shape)}, {tuple(state_slots.shape)} and {tuple(block_tables.shape)}"
        )
    dtypes = (positions.dtype, slot_mapping.dtype, state_slots.dtype, block_tables.dtype)
    if dtypes != (torch.int64, torch.int64, torch.int32, torch.int32):
        raise ValueError(f"decode_plan wants positions and slot_mapping int64, state_slots and block_tables int32; got {', '.join(map(str, dtypes))}")
    if block_size < 1 or window < 0 or groups < 0:
        raise ValueError(f"decode_plan wants block_size >= 1, window >= 0 and groups >= 0; got {block_size}, {window} and {groups}")
    for ratio in (*ratios, *(kind[0] for kind in rings)):
        if ratio < 1:
            raise ValueError(f"compression ratios are positive, got {ratio}")
        rows_per_block(block_size, ratio)
    for ratio, _, ring in rings:
        if ring % ratio:
            raise ValueError(f"a ring of {ring} rows splits windows of {ratio} tokens (caches.ring_size keeps it a multiple)")


@op(family="attention", outputs=OUTPUTS, compare=EXACT, golden_precision="native", model_types=V4_AND_V41)
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
    """The cache rows of a decode step of B sequences, one token each (row b is sequence b's token).

    positions: [B] int64; block_tables: [B, W] int32 (padded with any page); slot_mapping: [B] int64, the
    token's sliding-window cache slot, -1 for a padding row (a device graph's rows past the batch);
    state_slots: [B] int32, -1 for a row without one. Plain parameters: the KV `block_size`; the sliding
    `window`; `ratios`, the compression ratios to build entry tables for (R of them, in this order);
    `rings`, the compressor kinds to plan, K tuples (ratio, overlap, ring rows), ring rows a multiple of
    the ratio; `groups`, the output projection's groups.

    A row is live where slot_mapping >= 0, and has a state where it is live and state_slots >= 0. Every
    output is a plain tensor on the inputs' device, at a shape set by B, W and the parameters only:
    - positions [B] int64: the token's position, 0 on padding rows (their position is stale);
    - token_seq [B] int32: b (each token is its own sequence's);
    - window_rows [B, window] int32: the slots of positions p - window + 1 .. p, -1 before position 0
      and on padding rows;
    - entry_rows [B * (E_0 + .. + E_{R-1})] int32, ratio i's table [B, E_i] after those of ratios 0 .. i-1,
      E_i = W * block_size // ratios[i] (`entry_widths`, `split_entry_rows`): the pool row of sequence b's
      entry e, -1 from num_visible[i, b] on;
    - num_visible [R, B] int32: the entries complete at the token, (p + 1) // ratio, 0 on padding rows;
    - per compressor kind k, [K, B] int64 each, -1 where there is none unless said otherwise:
      ring_rows, the flat ring row (state_slot * ring + p % ring) the token's projections go to (rows
      with a state); window_starts, the flat ring row of the first token of the window that closes at
      the token ((p + 1) % ratio == 0, rows with a state); prev_starts, with overlap the previous
      window's first row (-1 for a sequence's first window, and always without overlap);
      entry_positions, the closing window's first position (its entry's rope position), 0 where none
      closes; pool_rows, the flat pool row the closing window's entry goes to (in the token's block);
    - group_rows [groups] int32: B each (the grouped output projection's masked-layout counts).
    """
    check_decode_plan_args(positions, block_tables, slot_mapping, state_slots, block_size, window, ratios, rings, groups)
    device, batch = positions.device, positions.shape[0]
    live = slot_mapping >= 0
    pos = torch.where(live, positions, 0)  # a padding row's position is stale: plan it at 0, and mask what it reads
    tables, visible = [], []
    for ratio in ratios:
        entries = torch.where(live, (pos + 1) // ratio, 0)  # those complete at the token: every entry of the sequence so far
        tables.append(_entry_table(entries, block_tables, block_size, ratio).view(-1))
        visible.append(entries.to(I32))
    with_state = live & (state_slots >= 0)
    kinds = [_ring_plan(pos, with_state, slot_mapping, state_slots, block_size, ratio, overlap, ring) for ratio, overlap, ring in rings]
    ring_fields = [torch.stack(field) for field in zip(*kinds)] if kinds else [torch.empty(0, batch, dtype=torch.int64, device=device) for _ in RING_FIELDS]
    return (
        pos,
        torch.arange(batch, dtype=I32, device=device),
        _window_rows(pos, live, block_tables, block_size, window),
        torch.cat(tables) if tables else torch.empty(0, dtype=I32, device=device),
        torch.stack(visible) if visible else torch.empty(0, batch, dtype=I32, device=device),
        *ring_fields,
        torch.full((groups,), batch, dtype=I32, device=device),
    )


def _window_rows(pos: torch.Tensor, live: torch.Tensor, block_tables: torch.Tensor, block_size: int, window: int) -> torch.Tensor:
    """[B, window] int32: the cache slots of positions p - window + 1 .. p, -1 before position 0 and on padding rows."""
    q = pos[:, None] + torch.arange(1 - window, 1, device=pos.device)
    at = q.clamp(min=0)
    pages = block_tables.gather(1, at // block_size).long()
    return (pages * block_size + at % block_size).masked_fill_((q < 0) | ~live[:, None], -1).to(I32)


def _entry_table(entries: torch.Tensor, block_tables: torch.Tensor, block_size: int, ratio: int) -> torch.Tensor:
    """[B, E_max] int32: the pool row of each sequence's entry e, -1 from entries[b] on. Entry e lives in the block of its
    window's last token: `rows` consecutive entries to a block, or with ratio > block size one entry in every `stride`-th
    block (one broadcast add, in int32)."""
    rows, stride = rows_per_block(block_size, ratio), max(1, ratio // block_size)
    pages = block_tables[:, stride - 1 :: stride].to(I32)
    table = (pages * rows)[:, :, None] + torch.arange(rows, dtype=I32, device=pages.device)
    width = pages.shape[1] * rows
    return table.view(pages.shape[0], width).masked_fill_(torch.arange(width, device=pages.device) >= entries[:, None], -1)


def _ring_plan(pos, with_state, slot_mapping, state_slots, block_size: int, ratio: int, overlap: bool, ring: int) -> tuple[torch.Tensor, ...]:
    """One compressor kind's (ring_rows, window_starts, prev_starts, entry_positions, pool_rows), [B] int64 each."""
    base = state_slots.long().clamp(min=0) * ring
    closes = with_state & ((pos + 1) % ratio == 0)
    first = pos + 1 - ratio  # the closing window's first position (where one closes)
    none = torch.full_like(pos, -1)
    window_starts = torch.where(closes, base + first % ring, none)
    prev_starts = torch.where(closes & (first > 0), base + (first - ratio) % ring, none) if overlap else none
    # The entry lives in the block of its window's last token: this token's.
    pool_rows = torch.where(closes, slot_mapping // block_size * rows_per_block(block_size, ratio) + pos % block_size // ratio, none)
    return torch.where(with_state, base + pos % ring, none), window_starts, prev_starts, torch.where(closes, first, 0), pool_rows
