"""A DeepSeek-V4 decode step's plan, built on the device from the batch's device tensors: fixed shapes, no host reads.

A decode step (every sequence brings one token, none of them replayed) needs nothing the host plan
(step.py) reads from the host: its tables follow from each token's position, its sequence's block
table, its cache slot and its state slot by tensor arithmetic. Built from device tensors only (no
`.item()`, no `nonzero`, no shape that depends on a value), the plan is part of the step a device
graph captures, and one graph per batch size serves every decode step (engine/decode_graphs.py).
The host does nothing per step that grows with the context.

The tables are the host plan's (step.V4Step), with these documented differences:
- entry tables (`RatioPlan.entry_rows`, `visible_rows`) are [B, E_max], E_max = the entries the block
  tables' width holds (W * block_size // ratio), -1 past each sequence's last entry (the host plan's
  are as wide as the longest sequence's entries: the same rows, fewer -1 columns);
- each compressor kind has a `RingPlan`, one entry per sequence: the token's projections are written
  into the ring first, then the window that closes at the token ((p + 1) % ratio == 0) is pooled in
  place from the ring's rows (`compress_kv` with window start -1 where none closes), which needs
  every window in consecutive ring rows (`caches.ring_size` keeps the ring a whole number of windows);
- padding rows (slot_mapping -1: a device graph's rows past the batch) and rows without a state slot
  read and write nothing of any sequence: window rows, entries and visible entries -1 (none), write
  slot, ring row, window start and pool row -1, rope position 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model.deepseek_v4.caches import rows_per_block
from deepinfer.model.deepseek_v4.config import V4Config
from deepinfer.model.deepseek_v4.step import RatioPlan, V4Step

I32 = torch.int32


@dataclass
class RingPlan:
    """One compressor kind (ratio, overlap) in a decode step: one entry per sequence, -1 where there is none."""

    ring_rows: torch.Tensor  # [B] int64: the flat ring row (slot * ring + position % ring) the token's projections go to
    window_starts: torch.Tensor  # [B] int64: flat ring row of the window closing at the token (its first token's), -1: none closes
    prev_starts: torch.Tensor  # [B] int64: with overlap, the previous window's first row; -1 for none or a first window
    positions: torch.Tensor  # [B] int64: the entry's rope position (its window's first token), 0 where none
    pool_rows: torch.Tensor  # [B] int64: flat pool row the entry is written to, -1 where none


def plan_decode(config: V4Config, positions: torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor, state_slots: torch.Tensor,
                block_size: int, rings: dict[tuple[int, bool], int]) -> V4Step:  # fmt: skip
    """The plan of a decode step of B sequences, one token each (row b is sequence b's token), on their device.

    positions: [B] int64; block_tables: [B, W] int32 (padded with any page); slot_mapping: [B] int64, the
    token's sliding-window cache slot, -1 for a padding row; state_slots: [B] int32, -1 for none;
    rings: the ring rows of each compressor kind the caches hold, (ratio, overlap) -> rows, each a multiple of
    its ratio (the kinds planned: a cache without compressors, an MTP block's sliding layer, needs none).
    """
    device = positions.device
    live = slot_mapping >= 0
    pos = torch.where(live, positions, 0)  # a padding row's position is stale: plan it at 0, and mask what it reads
    step = V4Step(
        pos,
        torch.arange(pos.shape[0], dtype=I32, device=device),
        _window_rows(pos, live, block_tables, block_size, config.sliding_window),
        slot_mapping,
    )
    for ratio in sorted({r for r, _ in rings}):
        entries = torch.where(live, (pos + 1) // ratio, 0)  # those complete at the token: every entry of the sequence so far
        table = entry_table(entries, block_tables, block_size, ratio)
        plan = RatioPlan(table, entries.to(I32))
        if (ratio, False) in rings:  # an HCA layer reads every visible entry
            plan.visible_rows = table  # a decode token sees every entry its sequence has
        step.ratios[ratio] = plan
    with_state = live & (state_slots >= 0)
    for (ratio, overlap), ring in sorted(rings.items()):
        if ring % ratio:
            raise ValueError(f"a ring of {ring} rows splits windows of {ratio} tokens (caches.ring_size keeps it a multiple)")
        step.compressors[(ratio, overlap)] = _ring_plan(pos, with_state, slot_mapping, state_slots, block_size, ratio, overlap, ring)
    return step


def _window_rows(pos: torch.Tensor, live: torch.Tensor, block_tables: torch.Tensor, block_size: int, window: int) -> torch.Tensor:
    """[B, window] int32: the cache slots of positions p - window + 1 .. p, -1 before position 0 and on padding rows."""
    q = pos[:, None] + torch.arange(1 - window, 1, device=pos.device)
    at = q.clamp(min=0)
    pages = block_tables.gather(1, at // block_size).long()
    return (pages * block_size + at % block_size).masked_fill_((q < 0) | ~live[:, None], -1).to(I32)


def entry_table(entries: torch.Tensor, block_tables: torch.Tensor, block_size: int, ratio: int) -> torch.Tensor:
    """[B, E_max] int32: the pool row of each sequence's entry e, -1 from entries[b] on; E_max = the entries the block
    tables hold (W * block_size // ratio). Entry e lives in the block of its window's last token: `rows` consecutive
    entries to a block, or with ratio > block size one entry in every `stride`-th block (one broadcast add, in int32).
    DeepSeek-V4.1's decode plan reads its paged history with it too (the same layout: its ratios divide the block size)."""
    rows, stride = rows_per_block(block_size, ratio), max(1, ratio // block_size)
    pages = block_tables[:, stride - 1 :: stride].to(I32)
    table = (pages * rows)[:, :, None] + torch.arange(rows, dtype=I32, device=pages.device)
    width = pages.shape[1] * rows
    return table.view(pages.shape[0], width).masked_fill_(torch.arange(width, device=pages.device) >= entries[:, None], -1)


def _ring_plan(pos, with_state, slot_mapping, state_slots, block_size: int, ratio: int, overlap: bool, ring: int) -> RingPlan:
    base = state_slots.long().clamp(min=0) * ring
    closes = with_state & ((pos + 1) % ratio == 0)
    first = pos + 1 - ratio  # the closing window's first position (where one closes)
    none = torch.full_like(pos, -1)
    window_starts = torch.where(closes, base + first % ring, none)
    prev_starts = torch.where(closes & (first > 0), base + (first - ratio) % ring, none) if overlap else none
    # The entry lives in the block of its window's last token: this token's.
    pool_rows = torch.where(closes, slot_mapping // block_size * rows_per_block(block_size, ratio) + pos % block_size // ratio, none)
    return RingPlan(
        ring_rows=torch.where(with_state, base + pos % ring, none),
        window_starts=window_starts,
        prev_starts=prev_starts,
        positions=torch.where(closes, first, 0),
        pool_rows=pool_rows,
    )
