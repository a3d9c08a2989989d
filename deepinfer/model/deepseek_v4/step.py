"""One step's index plan for DeepSeek-V4: which cache rows each token reads and writes.

Built once per forward on the host from the batch's host-side facts (positions, pages, state
slots), shared by every layer of the same type, and copied to the device in one go. The layers
then only gather, call ops and scatter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.model.deepseek_v4.config import CSA, V4Config


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
    window_rows: torch.Tensor  # [T, sliding_window] int32: flat sliding-window cache rows, -1 before position 0
    write_slots: torch.Tensor  # [T] int64: sliding-window cache slot each token writes, -1 for replayed tokens
    ratios: dict[int, RatioPlan] = field(default_factory=dict)
    compressors: dict[tuple[int, bool], CompressorPlan] = field(default_factory=dict)


def _ring_size(ratio: int, overlap: bool) -> int:
    return 2 * ratio if overlap else ratio


def _entry_row(pages: list[int], entry: int, ratio: int, block_size: int, rows: int) -> int:
    last = (entry + 1) * ratio - 1  # the entry lives in the block of its window's last token
    return pages[last // block_size] * rows + (last % block_size) // ratio


def plan_step(config: V4Config, seqs: list[SeqStep], block_size: int, device: torch.device) -> V4Step:
    window = config.sliding_window
    positions, token_seq, window_rows, write_slots = [], [], [], []
    for b, s in enumerate(seqs):
        for p in range(s.start, s.start + s.length):
            positions.append(p)
            token_seq.append(b)
            window_rows.append([s.pages[q // block_size] * block_size + q % block_size if q >= 0 else -1
                                for q in range(p - window + 1, p + 1)])  # fmt: skip
            write_slots.append(s.pages[p // block_size] * block_size + p % block_size if p >= s.cached else -1)

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    step = V4Step(
        tensor(positions, torch.int64), tensor(token_seq, torch.int32), tensor(window_rows, torch.int32).view(-1, window), tensor(write_slots, torch.int64)
    )
    kinds = {(config.compress_ratio(i), config.layer_types[i] == CSA) for i in range(config.num_hidden_layers) if config.compress_ratio(i)}
    for ratio in sorted({r for r, _ in kinds}):
        rows = max(1, block_size // ratio)
        ends = [(s.start + s.length) // ratio for s in seqs]
        width = max(ends, default=0)
        table = [[_entry_row(s.pages, e, ratio, block_size, rows) for e in range(n)] + [-1] * (width - n) for s, n in zip(seqs, ends)]
        visible = [(p + 1) // ratio for p in positions]
        plan = RatioPlan(tensor(table, torch.int32).view(len(seqs), width), tensor(visible, torch.int32))
        if any(not overlap for r, overlap in kinds if r == ratio):
            all_rows = [[table[b][e] if e < n else -1 for e in range(width)] for b, n in zip(token_seq, visible)]
            plan.visible_rows = tensor(all_rows, torch.int32).view(len(positions), width)
        step.ratios[ratio] = plan
    indexer_kinds = {(r, True) for r, overlap in kinds if overlap}  # the CSA indexer's own compressor
    for ratio, overlap in sorted(kinds | indexer_kinds):
        step.compressors[(ratio, overlap)] = _plan_compressor(seqs, ratio, overlap, block_size, tensor)
    return step


def _plan_compressor(seqs: list[SeqStep], ratio: int, overlap: bool, block_size: int, tensor) -> CompressorPlan:
    ring = _ring_size(ratio, overlap)
    rows = max(1, block_size // ratio)
    history, order, window_starts, prev_starts, entry_positions, pool_rows, ring_rows, ring_tokens = ([] for _ in range(8))
    spans = [_history_span(s, ratio, overlap) for s in seqs]
    num_history = sum(stop - first for first, stop in spans)
    token_base, history_base = 0, 0
    for s, (first_pos, stop) in zip(seqs, spans):
        source_start = len(order)  # where this sequence's sources begin in the ordered buffer
        for p in range(first_pos, stop):
            history.append(s.slot * ring + p % ring)
            order.append(history_base + p - first_pos)
        history_base += stop - first_pos
        order.extend(num_history + token_base + i for i in range(s.length))

        def source_row(p: int) -> int:
            return source_start + p - first_pos

        end = s.start + s.length
        for w in range(max(s.start, s.cached) // ratio, end // ratio):
            window_starts.append(source_row(w * ratio))
            prev_starts.append(source_row((w - 1) * ratio) if overlap and w > 0 else -1)
            entry_positions.append(w * ratio)
            pool_rows.append(_entry_row(s.pages, w, ratio, block_size, rows))
        for p in range(max(s.start, end - ring), end):
            ring_rows.append(s.slot * ring + p % ring)
            ring_tokens.append(token_base + p - s.start)
        token_base += s.length
    i64 = torch.int64
    return CompressorPlan(
        tensor(history, i64), tensor(order, i64), tensor(window_starts, i64), tensor(prev_starts, i64),
        tensor(entry_positions, i64), tensor(pool_rows, i64), tensor(ring_rows, i64), tensor(ring_tokens, i64),
    )  # fmt: skip


def _history_span(s: SeqStep, ratio: int, overlap: bool) -> tuple[int, int]:
    """Positions before this step that the entries emitted this step pool: [first, s.start), read from the ring."""
    first_window = max(s.start, s.cached) // ratio
    first = first_window * ratio - (ratio if overlap and first_window > 0 else 0)
    return min(first, s.start), s.start
