"""Cases for decode_plan, DeepSeek-V4's decode-step plan (deepinfer/ops/decode_plan.py): integer tables, compared exactly.

A few sequences each, their pages random and distinct, their positions at the edges: the first token, windows that
reach below position 0 and one that just fills, compressed windows closing (a sequence's first, with no previous
window, and later ones) and not closing; among them padding rows (slot -1, no state slot, a stale position and a zero
block table, as a device graph pads a batch) and a row with a cache slot but no state slot. Ratios below, at and
above the block size (one entry in every few blocks, the block tables' width not a whole number of them), overlapping
and plain compressor kinds with and without a speculative lookahead's longer rings, one ratio shared by both kinds,
and DeepSeek-V4.1's call (entry tables only: no window, no kinds). One nominal dtype: nothing here is a float.
"""

from __future__ import annotations

from functools import partial

import torch

from deepinfer_conformance.cases import Case

PADDING = None  # a row of rows=[...]: a device graph's padding row
STALE_POSITION = 7777  # what a padding row's position holds (never read)


def decode_plan_inputs(gen, dtype, *, rows: list[tuple[int, int] | None], width: int, block_size: int, window: int, ratios, rings, groups: int):
    """rows: (position, state slot or -1) per sequence, or PADDING; width: the block tables' pages (every sequence's
    pages random and distinct, and some spare)."""
    pages = torch.randperm(len(rows) * width + 3, generator=gen)[: len(rows) * width].view(len(rows), width).to(torch.int32)
    facts = []  # (position, cache slot, state slot) per row
    for b, row in enumerate(rows):
        if row is PADDING:
            pages[b] = 0
            facts.append((STALE_POSITION, -1, -1))
        else:
            position, state = row
            facts.append((position, int(pages[b, position // block_size]) * block_size + position % block_size, state))
    positions, slots, states = zip(*facts)
    return {
        "positions": torch.tensor(positions, dtype=torch.int64),
        "block_tables": pages,
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "state_slots": torch.tensor(states, dtype=torch.int32),
        "block_size": block_size,
        "window": window,
        "ratios": ratios,
        "rings": rings,
        "groups": groups,
    }


RECIPES = [
    # V4's layout, cut down: a window of 8 over pages of 16, CSA's ratio 4 (overlapping) and an HCA-like 32 (one entry
    # in every second page), rings 3 rows of lookahead longer (whole windows: 12 and 64); positions before, at and past
    # the window's reach, windows closing at 3 (the first CSA window), 31 (the first HCA one) and 63.
    ("v4_block16_window8_csa4_hca32_lookahead_rings",
     partial(decode_plan_inputs, rows=[(0, 0), (3, 1), PADDING, (7, 2), (8, 3), (31, 4), (47, -1), (63, 5), (94, 6), PADDING], width=6,
             block_size=16, window=8, ratios=(4, 32), rings=((4, True, 12), (32, False, 64)), groups=3)),
    # One ratio (8) for both kinds, as a config whose CSA and HCA rates agree: one entry table, an overlapping ring and
    # a plain one.
    ("shared_ratio8_block16_window4",
     partial(decode_plan_inputs, rows=[(7, 0), (15, 1), (2, 2), (16, -1), PADDING, (79, 3)], width=5, block_size=16, window=4, ratios=(8,),
             rings=((8, False, 8), (8, True, 16)), groups=1)),
    # A ratio equal to the block size and one of four blocks over block tables of 7 pages (one entry: the 8th page would
    # hold the second), windows of 16 rows.
    ("ratio16_and_64_block16_width7",
     partial(decode_plan_inputs, rows=[(63, 0), (15, 1), PADDING, (111, 2), (64, -1), (47, 3)], width=7, block_size=16, window=16, ratios=(16, 64),
             rings=((16, True, 32), (64, False, 64)), groups=2)),
    # DeepSeek-V4.1's call: the entry tables and visible counts of ratios 1 and 2 (pages of 4), no window, no kinds.
    ("v41_entries_ratio1_ratio2_block4",
     partial(decode_plan_inputs, rows=[(0, 0), (5, 1), PADDING, (14, 2), (7, -1)], width=4, block_size=4, window=0, ratios=(1, 2), rings=(), groups=0)),
]  # fmt: skip

CASES = [Case("decode_plan", name, torch.float32, make) for name, make in RECIPES]
