"""A DeepSeek-V4 decode step's plan, built on the device from the batch's device tensors: fixed shapes, no host reads.

A decode step (every sequence brings one token, none of them replayed) needs nothing the host plan
(step.py) reads from the host: its tables follow from each token's position, its sequence's block
table, its cache slot and its state slot by tensor arithmetic. Built from device tensors only (no
`.item()`, no `nonzero`, no shape that depends on a value), the plan is part of the step a device
graph captures, and one graph per batch size serves every decode step (engine/decode_graphs.py).
The host does nothing per step that grows with the context.

The tables come from one op, `decode_plan` (deepinfer/ops/decode_plan.py: its reference is this plan's torch
arithmetic; a backend computes every table in one kernel, where the torch code took ~50 small launches a step), and
are the host plan's (step.V4Step), with these documented differences:
- entry tables (`RatioPlan.entry_rows`, `visible_rows`) are [B, E_max], E_max = the entries the block
  tables' width holds (W * block_size // ratio), -1 past each sequence's last entry (the host plan's
  are as wide as the longest sequence's entries: the same rows, fewer -1 columns);
- each compressor kind has a `RingPlan`, one entry per sequence: the token's projections are written
  into the ring first, then the window that closes at the token ((p + 1) % ratio == 0) is pooled in
  place from the ring's rows (`compress_kv` with window start -1 where none closes), which needs
  every window in consecutive ring rows (`caches.ring_size` keeps the ring a whole number of windows);
- padding rows (slot_mapping -1: a device graph's rows past the batch) read and write nothing of any
  sequence: window rows, entries and visible entries -1 (none), write slot, ring row, window start and
  pool row -1, rope position 0;
- a row without a state slot (-1) but with a cache slot (a start-up probe's) reads its window and its
  entries and writes its KV, but keeps no compressor state: ring row, window start and pool row -1.
Dtypes are those the layers take: positions, write slots and every RingPlan table int64; token_seq, window rows,
entry tables, visible counts and `group_rows` (the output projection's masked counts, B each) int32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model.deepseek_v4.config import V4Config
from deepinfer.model.deepseek_v4.step import RatioPlan, V4Step
from deepinfer.ops.decode_plan import OUTPUTS, split_entry_rows


@dataclass
class RingPlan:
    """One compressor kind (ratio, overlap) in a decode step: one entry per sequence, -1 where there is none."""

    ring_rows: torch.Tensor  # [B] int64: the flat ring row (slot * ring + position % ring) the token's projections go to
    window_starts: torch.Tensor  # [B] int64: flat ring row of the window closing at the token (its first token's), -1: none closes
    prev_starts: torch.Tensor  # [B] int64: with overlap, the previous window's first row; -1 for none or a first window
    positions: torch.Tensor  # [B] int64: the entry's rope position (its window's first token), 0 where none
    pool_rows: torch.Tensor  # [B] int64: flat pool row the entry is written to, -1 where none


def plan_decode(ops, config: V4Config, positions: torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor, state_slots: torch.Tensor,
                block_size: int, rings: dict[tuple[int, bool], int]) -> V4Step:  # fmt: skip
    """The plan of a decode step of B sequences, one token each (row b is sequence b's token), on their device: one
    `decode_plan` call, its tables filled into the layers' dataclasses (views, no launch).

    positions: [B] int64; block_tables: [B, W] int32 (padded with any page); slot_mapping: [B] int64, the
    token's sliding-window cache slot, -1 for a padding row; state_slots: [B] int32, -1 for none;
    rings: the ring rows of each compressor kind the caches hold, (ratio, overlap) -> rows, each a multiple of
    its ratio (the kinds planned: a cache without compressors, an MTP block's sliding layer, needs none).
    """
    ratios = tuple(sorted({r for r, _ in rings}))
    kinds = sorted(rings.items())
    out = dict(zip(OUTPUTS, ops.decode_plan(
        positions, block_tables, slot_mapping, state_slots, block_size=block_size, window=config.sliding_window, ratios=ratios,
        rings=tuple((ratio, overlap, ring) for (ratio, overlap), ring in kinds), groups=config.o_groups,
    )))  # fmt: skip
    step = V4Step(out["positions"], out["token_seq"], out["window_rows"], slot_mapping, group_rows=out["group_rows"])
    tables = split_entry_rows(out["entry_rows"], positions.shape[0], block_size, block_tables.shape[1], ratios)
    for i, (ratio, table) in enumerate(zip(ratios, tables)):
        plan = RatioPlan(table, out["num_visible"][i])
        if (ratio, False) in rings:  # an HCA layer reads every visible entry
            plan.visible_rows = table  # a decode token sees every entry its sequence has
        step.ratios[ratio] = plan
    for k, (kind, _) in enumerate(kinds):
        step.compressors[kind] = RingPlan(
            ring_rows=out["ring_rows"][k], window_starts=out["window_starts"][k], prev_starts=out["prev_starts"][k],
            positions=out["entry_positions"][k], pool_rows=out["pool_rows"][k],
        )  # fmt: skip
    return step
