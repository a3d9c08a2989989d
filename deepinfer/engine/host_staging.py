"""Host lists to device tensors through one copy; the host-side tables a step's inputs are built from.

A step's inputs are a handful of small integer and float lists (token ids, positions, slots, block
tables, sampling parameters). Copied one tensor at a time, each is a host-to-device transfer of its
own: on the H200, 13 per decode step, each a few microseconds of host time and a gap on the device
between the graphs it replays. Packed into one host byte buffer (pinned where the device runs behind
the host, so the copy is truly asynchronous), they cross in one transfer and come back as views of
one device buffer: no copy kernel per field.
"""

from __future__ import annotations

from array import array

import torch

ALIGN = 16  # every field starts on a 16-byte boundary of the buffer: any dtype's view of it is aligned


def to_device(fields: list[tuple[list | torch.Tensor, torch.dtype]], device: torch.device, pinned: bool) -> list[torch.Tensor]:
    """Each (values, dtype) as a tensor on `device` (values: a flat or rectangular nested list, or a host
    tensor already built, e.g. by `padded_rows`), all through one host-to-device copy, without waiting for it."""
    hosts = [values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype) for values, dtype in fields]
    offsets, end = [], 0
    for t in hosts:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    packed = torch.empty(max(end, ALIGN), dtype=torch.uint8, pin_memory=pinned)
    for t, at in zip(hosts, offsets):
        if t.numel():
            packed[at : at + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
    arrived = packed.to(device, non_blocking=True) if packed.device != device else packed
    return [arrived[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for t, at in zip(hosts, offsets)]


def padded_rows(rows: list[list[int]], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """[len(rows), longest] host tensor of the rows, padded with 0 (block tables): read through array.fromlist,
    several times faster than torch.tensor over nested lists (a decode step's tables hold batch x pages ints)."""
    width = max(map(len, rows), default=0)
    flat = array("q")
    padding = [0] * width
    for row in rows:
        flat.fromlist(row)
        flat.fromlist(padding[len(row) :])
    if not flat:
        return torch.zeros(len(rows), width, dtype=dtype)
    return torch.frombuffer(flat, dtype=torch.int64).view(len(rows), width).to(dtype)


def flat_ints(rows: list[list[int]]) -> torch.Tensor:
    """The rows concatenated as one int64 host tensor, read through array.fromlist (a prefill chunk's token ids: torch.tensor
    over a 16384-long list comprehension took about a millisecond)."""
    flat = array("q")
    for row in rows:
        flat.fromlist(row)
    return torch.frombuffer(flat, dtype=torch.int64) if flat else torch.zeros(0, dtype=torch.int64)


def segments(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner, offset) of every item of the concatenated segments of `counts` items (int64): item i is item offset[i] of
    segment owner[i]."""
    total = int(counts.sum())
    starts = counts.cumsum(0) - counts
    # The owner of an item: the segments starting at or before it, less one (an empty segment starts where the next
    # does). Not repeat_interleave: its CPU kernel forks a thread team even for a few items.
    owner = torch.bincount(starts, minlength=total + 1)[:total].cumsum(0) - 1
    return owner, torch.arange(total) - starts[owner]


LOOP_TOKENS = 256  # up to this many tokens a step (decode batches), token_slots' Python loop beats its dozen tensor operations


def token_slots(starts: list[int], lengths: list[int], tables: list[list[int]], padded: torch.Tensor, block_size: int
                ) -> tuple[list[int] | torch.Tensor, list[int] | torch.Tensor]:  # fmt: skip
    """(positions, slots) over the step's tokens: sequence b's lengths[b] tokens at positions starts[b], starts[b] + 1, ...,
    and the paged cache slot of each (tables: the block tables; padded: the same as `padded_rows` lays them out, which the
    step uploads anyway). A prefill chunk's by tensor operations on the host
    (int64 tensors; the per-token loop took 4.5 ms at 16384 tokens on a 2-core CPU, these 0.7 ms); a decode step's, up to
    LOOP_TOKENS, by that loop (lists: about 70 us less at batch 1)."""
    if sum(lengths) <= LOOP_TOKENS:
        positions = [p for start, n in zip(starts, lengths) for p in range(start, start + n)]
        slots = [table[p // block_size] * block_size + p % block_size for start, n, table in zip(starts, lengths, tables) for p in range(start, start + n)]
        return positions, slots
    owner, offset = segments(torch.tensor(lengths, dtype=torch.int64))
    positions = torch.tensor(starts, dtype=torch.int64)[owner] + offset
    pages = padded.to(torch.int64).view(-1).index_select(0, owner * padded.shape[1] + positions // block_size)
    return positions, pages * block_size + positions % block_size
