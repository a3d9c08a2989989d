"""A DeepSeek-V4.1 decode step's plan, built on the device from the batch's device tensors: fixed shapes, no host reads.

A decode step (every sequence brings one new token) needs none of the per-span host facts (spans.py): the ring rows a
token's window reads, where its compressor writes and which paged entries it sees follow from its position, its
state slot and its block table by tensor arithmetic. Built from device tensors only (no `.item()`, no `nonzero`, no
shape that depends on a value; every table sized by the batch and its block tables' width, which a device graph fixes
at max_model_len), the plan is part of the step a device graph captures, and one graph per batch size serves every
decode step (engine/decode_graphs.py), as DeepSeek-V4's decode_plan.py does for V4.

The layers read the rows the per-span path reads, in the same order, so both give the same numbers:
- window: token b's positions p - window + 1 .. p, ring row q % ring rows of its slot, in position order, -1 before
  position 0. A decode token's window never reaches below its sequence's `decoder_from` (the bounded replay's tail
  holds at least the window and a decode token lies past the prompt), so the per-span path's mask there is moot
  (`plans_on_device` checks it where the host knows the tail; a device graph's batch comes from the engine's decode
  steps, for which it holds);
- compressed entries, per ratio: the sequence's entry e at pool row `entry_table[b, e]` (DeepSeek-V4's layout), -1 from
  `visible` = (p + 1) // ratio on: the entry tables, the visible counts and the planned positions of every ratio come
  from DeepSeek-V4's `decode_plan` op in one call (deepinfer/ops/decode_plan.py; no window, no compressor kinds: V4.1's
  window rows are its ring's, its pending rows its own), given the slot mapping with this plan's padding rows at -1; the
  entry whose group closes at p (p + 1 a multiple of the ratio) is written to its row, every other token's to the
  scratch block (caches.py);
- padding rows (slot_mapping or state slot -1: a device graph's rows past the batch) read nothing (window rows and
  visible entries -1, Engram's history pad) and write only the scratch slot and block; their position is planned as 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.model.deepseek_v41.caches import V41State
from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.ops.decode_plan import OUTPUTS, split_entry_rows

I32 = torch.int32


@dataclass
class RatioDecode:
    """One compression ratio's tables in a decode step (shared by its KV sources: same ratio, same rows)."""

    entry_table: torch.Tensor  # [B, E] int32: flat pool row of each sequence's entry e, -1 from visible[b] on
    visible: torch.Tensor  # [B] int32: entries complete at the token's position (0 on padding rows)
    write_rows: torch.Tensor  # [B] int64: flat pool row of the entry closing at the token; the scratch block's row where none closes
    group_first: torch.Tensor  # [B] int64: the closing group's first position (its entry's rope position), 0 where none closes
    pool_starts: torch.Tensor  # [B] int64: b * ratio, the group's first row among the [B * ratio] pooled rows; -1 where none closes
    pending_reads: torch.Tensor  # [B, ratio - 1] int64: flat pending rows of the group's earlier tokens (ratio > 1)
    pending_write: torch.Tensor  # [B] int64: flat pending row the token's projections go to (the scratch slot's for padding)


@dataclass
class V41DecodePlan:
    positions: torch.Tensor  # [B] int64, 0 on padding rows
    window_rows: torch.Tensor  # [B, window] int64: flat ring rows of positions p - window + 1 .. p (any row where none)
    window_indices: torch.Tensor  # [B, window] int32: b * window + j over the gathered rows, -1 before position 0 and on padding rows
    ring_write: torch.Tensor  # [B] int64: flat ring row the token's window row goes to
    engram_reads: torch.Tensor | None  # [B, max_ngram - 1] int64: flat rows of the ids 1 .. max_ngram - 1 tokens back, -1 before position 0
    engram_write: torch.Tensor | None  # [B] int64: flat row the token's compressed id goes to
    ratios: dict[int, RatioDecode] = field(default_factory=dict)


def plans_on_device(batch: ForwardBatch, config: V41Config) -> bool:
    """Whether a step runs as a decode step planned here: not a prefill, one token per sequence, with state slots, none
    of them replayed over cached blocks, and (where the host says) every window past its sequence's decoder tail start.
    A device graph's batch has no host facts and is always such a step."""
    if batch.is_prefill or batch.max_query_len != 1 or batch.state_slots is None or batch.input_ids.shape[0] != batch.num_seqs:
        return False
    host = batch.host
    if host is None:
        return True
    lowest = [max(0, start - config.sliding_window + 1) for start in host.starts]  # the first position each window reads
    tails = host.decoder_from or [0] * len(lowest)
    return all(cached <= start for cached, start in zip(host.cached, host.starts)) and all(tail <= low for tail, low in zip(tails, lowest))


def plan_decode(ops, config: V41Config, batch: ForwardBatch, caches: V41State) -> V41DecodePlan:
    """The plan of a decode step of B sequences, one token each (row b is sequence b's), for caches laid out by
    caches.allocate (its ring, pending and Engram rows, its blocks of `rows_per_block * ratio` tokens)."""
    window = config.sliding_window
    live = (batch.slot_mapping >= 0) & (batch.state_slots >= 0)
    pools = {role.ratio: state.entries.shape for role, state in zip(config.roles, caches.layers) if role.has_compressor}
    ratios = tuple(sorted(pools))
    block_size = next((shape[1] * ratio for ratio, shape in pools.items()), 1)  # (1: no ratio, no entry table to lay out)
    entries = dict(zip(OUTPUTS, ops.decode_plan(
        batch.positions, batch.block_tables, torch.where(live, batch.slot_mapping, -1), batch.state_slots, block_size=block_size, window=0,
        ratios=ratios, rings=(), groups=0,
    )))  # fmt: skip
    pos = entries["positions"]  # a padding row's position is stale: planned at 0, and what it reads masked
    tables = split_entry_rows(entries["entry_rows"], pos.shape[0], block_size, batch.block_tables.shape[1], ratios)
    slots = torch.where(live, batch.state_slots.long(), caches.scratch_slot)
    ring = caches.layers[0].ring.shape[1]
    seen = pos[:, None] + torch.arange(1 - window, 1, device=pos.device)  # [B, window]
    gathered = torch.arange(seen.numel(), dtype=I32, device=pos.device).view(seen.shape)
    plan = V41DecodePlan(
        positions=pos,
        window_rows=slots[:, None] * ring + seen.clamp(min=0) % ring,
        window_indices=torch.where((seen >= 0) & live[:, None], gathered, -1),
        ring_write=slots * ring + pos % ring,
        engram_reads=None,
        engram_write=None,
    )
    if caches.engram_ids is not None:
        rows = caches.engram_ids.shape[1]
        back = pos[:, None] - torch.arange(config.engram_max_ngram_size - 1, 0, -1, device=pos.device)  # oldest first
        plan.engram_reads = torch.where(back >= 0, slots[:, None] * rows + back.clamp(min=0) % rows, -1)
        plan.engram_write = slots * rows + pos % rows
    for role, state in zip(config.roles, caches.layers):
        if role.has_compressor and role.ratio not in plan.ratios:
            i = ratios.index(role.ratio)
            plan.ratios[role.ratio] = _ratio_decode(
                role.ratio, pos, live, slots, batch.block_tables, tables[i], entries["num_visible"][i], state.entries.shape, state.pending.shape[1]
            )
    return plan


def _ratio_decode(ratio: int, pos, live, slots, block_tables, table, visible, pool_shape, pending_rows: int) -> RatioDecode:
    blocks, per_block = pool_shape[0], pool_shape[1]
    block_size = per_block * ratio
    closes = live & ((pos + 1) % ratio == 0)
    page = block_tables.gather(1, (pos // block_size)[:, None])[:, 0].long()  # the block of the token: its group's
    scratch = (blocks - 1) * per_block
    earlier = pos[:, None] - torch.arange(ratio - 1, 0, -1, device=pos.device)  # the group's other tokens, oldest first
    return RatioDecode(
        entry_table=table,
        visible=visible,
        write_rows=torch.where(closes, page * per_block + pos % block_size // ratio, scratch),
        group_first=torch.where(closes, pos + 1 - ratio, 0),
        pool_starts=torch.where(closes, torch.arange(pos.shape[0], device=pos.device) * ratio, -1),
        pending_reads=slots[:, None] * pending_rows + earlier.clamp(min=0) % pending_rows,
        pending_write=slots * pending_rows + pos % pending_rows,
    )
