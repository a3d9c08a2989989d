"""One step's index plan for DeepSeek-V4: which cache rows each token reads and writes.

Built once per forward on the host from the batch's host-side facts (positions, pages, state
slots), shared by every layer of the same type, then copied to the device. The layers then only
gather, call ops and scatter. A decode step's plan is built on the device instead (decode_plan.py:
the same tables at fixed shapes, what a device graph captures); this one serves every other step
(prefill chunks, mixed steps, prefix-hit replay, speculative verification).

Every table is tensor arithmetic over the batch's padded page matrix, never a Python loop per token
or entry: at V4-Flash decode sizes the ratio-4 entry table alone holds batch x context / 4 rows.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, fields, replace

import torch

from deepinfer.engine.host_staging import segments
from deepinfer.model.deepseek_v4.caches import ring_size
from deepinfer.model.deepseek_v4.config import CSA, V4Config

I32, I64 = torch.int32, torch.int64


@dataclass
class SeqStep:
    """What the host knows of one sequence in this step."""

    start: int  # position of its first token in this step
    length: int  # tokens in this step
    cached: int  # positions below this already have their KV paged (a prefix hit's replayed tokens do not rewrite it)
    slot: int  # its state slot
    pages: list[int]  # its block table


@dataclass
class CompressorPlan:
    """Sources and destinations of one compressor kind (ratio, overlap) in this step."""

    history: torch.Tensor  # [H] int64 rows of the flat ring (slot * ring + position % ring) to read
    order: torch.Tensor  # [H + T] int64: cat(history rows, this step's rows)[order] lays each sequence's sources out contiguously
    window_starts: torch.Tensor  # [E] int64 into the ordered sources
    prev_starts: torch.Tensor  # [E] int64 into the ordered sources, -1 for a first window
    positions: torch.Tensor  # [E] int64: each entry's rope position (its window's first token)
    pool_rows: torch.Tensor  # [E] int64: where each entry is written (flat pool rows)
    ring_rows: torch.Tensor  # [R] int64: flat ring rows this step's tokens are written to
    ring_tokens: torch.Tensor  # [R] int64: which of this step's tokens


@dataclass
class RatioPlan:
    """The entries visible per token for one compression ratio (shared by the pool and the indexer keys)."""

    entry_rows: torch.Tensor  # [B, E] int32: flat pool row of each sequence's entry e (-1 past its last)
    num_visible: torch.Tensor  # [T] int32: entries whose window is complete at the token's position
    visible_rows: torch.Tensor | None = None  # [T, E] int32: every visible entry's row, -1 beyond (HCA reads them all)


@dataclass
class V4Step:
    positions: torch.Tensor  # [T] int64
    token_seq: torch.Tensor  # [T] int32
    window_rows: torch.Tensor | None  # [T, sliding_window] int32: flat sliding-window cache rows, -1 before position 0
    write_slots: torch.Tensor  # [T] int64: sliding-window cache slot each token writes, -1 for replayed tokens
    ratios: dict[int, RatioPlan] = field(default_factory=dict)
    compressors: dict[tuple[int, bool], CompressorPlan] = field(default_factory=dict)  # a decode step's: decode_plan.RingPlan
    group_rows: torch.Tensor | None = None  # [o_groups] int32, each the step's token count: the output projection's masked_m (the model's)


def plan_step(config: V4Config, seqs: list[SeqStep], block_size: int, device: torch.device, lookahead: int = 0,
              rings: dict[tuple[int, bool], int] | None = None, upload=None) -> V4Step:  # fmt: skip
    """rings: the caches' ring rows per compressor kind, (ratio, overlap) -> rows (a kind not given: `caches.ring_size`
    with `lookahead`). upload: HostBatch.upload, the engine's one-copy staging of host tensors (None: a copy each)."""
    batch = _Batch.of(seqs, block_size)
    step, (pages,) = _to_device(_plan_on_host(config, batch, {**ring_sizes(config, lookahead), **(rings or {})}), device, upload, also=[batch.pages])
    # The per-token tables are the largest (an 8192-token chunk: the window rows 1M slots, ~20 ms of host time; an HCA
    # layer's visible rows at 16384 tokens 2M, ~2 ms and 8 MB to upload): computed where the tables went, from the block
    # tables and the entry tables, in a few launches on the device, with no value read back.
    step.window_rows = _window_rows(pages, block_size, step.token_seq, step.positions, config.sliding_window)
    for ratio in _ratios_reading_every_entry(config):
        plan = step.ratios[ratio]
        plan.visible_rows = _visible_rows(plan.entry_rows, step.token_seq, plan.num_visible)
    return step


def layer_kinds(config: V4Config) -> set[tuple[int, bool]]:
    """(ratio, overlap) of the compressed layers: overlap for CSA (the entries' compressor), not for HCA."""
    return {(config.compress_ratio(i), config.layer_types[i] == CSA) for i in range(config.num_hidden_layers) if config.compress_ratio(i)}


def compressor_kinds(config: V4Config) -> list[tuple[int, bool]]:
    """Every compressor kind (ratio, overlap) a step plans: the layers' and the CSA indexer's own (overlapping)."""
    kinds = layer_kinds(config)
    return sorted(kinds | {(r, True) for r, overlap in kinds if overlap})


def ring_sizes(config: V4Config, lookahead: int = 0) -> dict[tuple[int, bool], int]:
    return {(ratio, overlap): ring_size(ratio, overlap, lookahead) for ratio, overlap in compressor_kinds(config)}


def _plan_on_host(config: V4Config, batch: _Batch, rings: dict[tuple[int, bool], int]) -> V4Step:
    token_seq, offset = segments(batch.length)
    positions = batch.start[token_seq] + offset
    step = V4Step(positions, token_seq.to(I32), None, _write_slots(batch, token_seq, positions))  # window rows: plan_step
    kinds = layer_kinds(config)
    for ratio in sorted({r for r, _ in kinds}):
        visible = (positions + 1) // ratio  # entries whose window is complete at the token's position
        step.ratios[ratio] = RatioPlan(_entry_table(batch, ratio), visible.to(I32))  # visible_rows: plan_step, on the device
    for ratio, overlap in compressor_kinds(config):
        step.compressors[(ratio, overlap)] = _plan_compressor(batch, token_seq, positions, ratio, overlap, rings[(ratio, overlap)])
    return step


def _to_device(step: V4Step, device: torch.device, upload=None, also: list[torch.Tensor] = ()) -> tuple[V4Step, list[torch.Tensor]]:
    """The same plan with every table on `device` (a no-op on the host). With `upload`, all of them in one
    transfer that does not wait: a prefill chunk's tables are megabytes (8192 tokens: the window rows alone
    4 MB), and one pageable copy per table made the host wait for the device's previous step each time
    (the H100's 8 x 8192 prefill profile: the device idle 17% of the pass). `also`: more tensors for the same
    transfer, returned moved beside the plan."""
    plans = [step, *step.ratios.values(), *step.compressors.values()]
    found = [(plan, f.name, getattr(plan, f.name)) for plan in plans for f in fields(plan) if isinstance(getattr(plan, f.name), torch.Tensor)]
    tensors = [t for _, _, t in found] + list(also)
    if upload is not None:
        arrived = upload([(t, t.dtype) for t in tensors])
    else:
        arrived = [t.to(device, non_blocking=True) for t in tensors]
    arrived, extra_arrived = arrived[: len(found)], arrived[len(found) :]
    moved = {id(plan): {} for plan in plans}
    for (plan, name, _), t in zip(found, arrived):
        moved[id(plan)][name] = t
    out = replace(step, **moved[id(step)])
    out.ratios = {ratio: replace(plan, **moved[id(plan)]) for ratio, plan in step.ratios.items()}
    out.compressors = {kind: replace(plan, **moved[id(plan)]) for kind, plan in step.compressors.items()}
    return out, list(extra_arrived)


# ---- the batch as tensors ----------------------------------------------------------------------


@dataclass
class _Batch:
    """The host facts of the step's sequences as int64 tensors, one row per sequence."""

    start: torch.Tensor  # [B]
    length: torch.Tensor  # [B]
    cached: torch.Tensor  # [B]
    slot: torch.Tensor  # [B]
    end: torch.Tensor  # [B]: start + length
    pages: torch.Tensor  # [B, max_pages]: the block tables, padded with 0 (padding is only ever read masked)
    block_size: int

    @classmethod
    def of(cls, seqs: list[SeqStep], block_size: int) -> _Batch:
        start, length, cached, slot = torch.tensor([(s.start, s.length, s.cached, s.slot) for s in seqs], dtype=I64).view(-1, 4).unbind(1)
        return cls(start, length, cached, slot, start + length, _page_matrix([s.pages for s in seqs]), block_size)


def _page_matrix(tables: list[list[int]]) -> torch.Tensor:
    width = max(map(len, tables), default=0)
    padding = [0] * width
    flat = array("q")  # array.fromlist reads Python ints several times faster than torch.tensor does
    for table in tables:
        flat.fromlist(table)
        flat.fromlist(padding[len(table) :])
    if not flat:
        return torch.zeros(len(tables), width, dtype=I64)
    return torch.frombuffer(flat, dtype=I64).view(len(tables), width)


def _starts(counts: torch.Tensor) -> torch.Tensor:
    """Where each segment of `counts` items begins once they are concatenated."""
    return counts.cumsum(0) - counts


# ---- the sliding window ------------------------------------------------------------------------


def _page_at(batch: _Batch, seq: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """batch.pages[seq, index] (broadcast together), by index_select over the flat matrix: a few times faster than
    advanced indexing on the CPU."""
    flat = seq * batch.pages.shape[1] + index
    return batch.pages.view(-1).index_select(0, flat.view(-1)).view(flat.shape)


def _token_slots(batch: _Batch, seq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Flat sliding-window cache slots of `positions` (>= 0) of sequences `seq` (broadcast together)."""
    bs = batch.block_size
    return _page_at(batch, seq, positions // bs) * bs + positions % bs


def _window_rows(pages: torch.Tensor, block_size: int, token_seq: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """[T, window] int32: the slots of positions p - window + 1 .. p of each token at p, -1 before position 0, from the
    padded block tables `pages` [B, max_pages] on the tokens' device."""
    q = positions[:, None] + torch.arange(1 - window, 1, device=positions.device)
    at = q.clamp(min=0)
    flat = token_seq.long()[:, None] * pages.shape[1] + at // block_size
    return (pages.view(-1).index_select(0, flat.view(-1)).view(flat.shape) * block_size + at % block_size).masked_fill_(q < 0, -1).to(I32)


def _write_slots(batch: _Batch, token_seq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[T] int64: the slot each token writes, -1 where its KV is already paged (a replayed token)."""
    return _token_slots(batch, token_seq, positions).masked_fill_(positions < batch.cached[token_seq], -1)


# ---- compressed entries ------------------------------------------------------------------------


def _entry_rows(batch: _Batch, seq: torch.Tensor, entry: torch.Tensor, ratio: int) -> torch.Tensor:
    """Flat pool rows of entries `entry` of sequences `seq` (broadcast together)."""
    bs = batch.block_size
    last = (entry + 1) * ratio - 1  # the entry lives in the block of its window's last token
    return _page_at(batch, seq, last // bs) * max(1, bs // ratio) + (last % bs) // ratio


def _entry_table(batch: _Batch, ratio: int) -> torch.Tensor:
    """[B, E] int32: each sequence's entry rows up to the end of this step, -1 past its last; E the longest."""
    ends = batch.end // ratio
    width = int(ends.max()) if len(ends) else 0
    bs = batch.block_size
    if bs % ratio and ratio % bs:  # a layout the caches refuse (rows_per_block): entry by entry
        table = _entry_rows(batch, torch.arange(len(ends))[:, None], torch.arange(width), ratio).to(I32)
    else:  # `rows` consecutive entries to a block; with ratio > block size, one in every `stride`-th block
        rows, stride = max(1, bs // ratio), max(1, ratio // bs)
        table = _blocked_entry_rows(batch.pages[:, stride - 1 :: stride], rows, width)
    shortest = int(ends.min()) if len(ends) else 0  # padding lies only past the shortest sequence's end
    table[:, shortest:].masked_fill_(torch.arange(shortest, width) >= ends[:, None], -1)
    return table


def _blocked_entry_rows(pages: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """[B, width] int32: entry e at row e % rows of pages[:, e // rows]: one broadcast add over the pages, written in
    place (width need not be a whole number of blocks)."""
    first_rows = pages[:, : -(-width // rows)].to(I32) * rows
    table = torch.empty(len(pages), width, dtype=I32)
    full = width // rows  # blocks whose entries all lie in the table
    torch.add(first_rows[:, :full, None], torch.arange(rows, dtype=I32), out=table[:, : full * rows].view(len(pages), full, rows))
    table[:, full * rows :] = first_rows[:, full:] + torch.arange(width - full * rows, dtype=I32)
    return table


def _ratios_reading_every_entry(config: V4Config) -> list[int]:
    """The ratios of HCA layers (no overlap): their tokens read every visible entry, so they need `visible_rows`."""
    kinds = layer_kinds(config)
    return sorted({ratio for ratio, overlap in kinds if not overlap})


def _visible_rows(table: torch.Tensor, token_seq: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """[T, E] int32: the rows of the first `visible` entries of each token's sequence, -1 beyond, on the tensors'
    device (two launches, nothing read back)."""
    rows = table.index_select(0, token_seq)
    return rows.masked_fill_(torch.arange(table.shape[1], device=table.device) >= visible[:, None], -1)


# ---- compressors -------------------------------------------------------------------------------


def _plan_compressor(batch: _Batch, token_seq: torch.Tensor, positions: torch.Tensor, ratio: int, overlap: bool, ring: int) -> CompressorPlan:
    # The entries to emit: windows closing in this step, from the first whose entry is not paged yet.
    first_window = torch.maximum(batch.start, batch.cached) // ratio
    # Their sources before this step, read from the ring: [first, start); an overlapping window also pools the one before.
    back = ratio * (first_window > 0) if overlap else 0
    first = torch.minimum(first_window * ratio - back, batch.start)
    history_lens = batch.start - first
    history_seq, history_offset = segments(history_lens)
    history = batch.slot[history_seq] * ring + (first[history_seq] + history_offset) % ring

    # Sources: cat(history rows, token rows), laid out by sequence (its history, then its tokens): its positions first .. end - 1.
    num_history, num_tokens = len(history), len(positions)
    token_source = torch.arange(num_tokens) + history_lens.cumsum(0)[token_seq]  # after its own sequence's history
    history_source = torch.arange(num_history) + _starts(batch.length)[history_seq]  # after earlier sequences' tokens
    order = torch.empty(num_history + num_tokens, dtype=I64)
    order[history_source] = torch.arange(num_history)
    order[token_source] = torch.arange(num_history, num_history + num_tokens)

    # An entry is emitted at the token that closes its window.
    closes = ((positions + 1) % ratio == 0) & (positions + 1 > first_window[token_seq] * ratio)
    closing = closes.nonzero().squeeze(1)
    window = (positions[closing] + 1) // ratio - 1
    window_starts = token_source[closing] - (ratio - 1)
    prev_starts = torch.where(window > 0, window_starts - ratio, -1) if overlap else torch.full_like(window, -1)
    pool_rows = _entry_rows(batch, token_seq[closing], window, ratio)

    # The ring keeps each sequence's last `ring` tokens.
    ring_tokens = (positions >= (batch.end - ring)[token_seq]).nonzero().squeeze(1)
    ring_rows = batch.slot[token_seq[ring_tokens]] * ring + positions[ring_tokens] % ring
    return CompressorPlan(history, order, window_starts, prev_starts, window * ratio, pool_rows, ring_rows, ring_tokens)
