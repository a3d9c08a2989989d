"""Host lists to device tensors through one copy.

A step's inputs are a handful of small integer and float lists (token ids, positions, slots, block
tables, sampling parameters). Copied one tensor at a time, each is a host-to-device transfer of its
own: on the H200, 13 per decode step, each a few microseconds of host time and a gap on the device
between the graphs it replays. Packed into one host byte buffer (pinned where the device runs behind
the host, so the copy is truly asynchronous), they cross in one transfer and come back as views of
one device buffer: no copy kernel per field.
"""

from __future__ import annotations

import torch

ALIGN = 16  # every field starts on a 16-byte boundary of the buffer: any dtype's view of it is aligned


def to_device(fields: list[tuple[list, torch.dtype]], device: torch.device, pinned: bool) -> list[torch.Tensor]:
    """Each (values, dtype) as a tensor on `device` (values: a flat or rectangular nested list), all
    through one host-to-device copy, without waiting for it."""
    hosts = [torch.tensor(values, dtype=dtype) for values, dtype in fields]
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
