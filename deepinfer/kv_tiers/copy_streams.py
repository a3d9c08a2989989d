"""Where the KV tiers' copies run: on side streams of an accelerator, or synchronously on the CPU.

A tier's copies must not hold up the engine's steps: on an accelerator the copies out (device to pinned host rows)
and in (host rows to device blocks) are queued on two streams of their own, each first waiting for the work already
queued on the engine's stream (the blocks' last writer or reader), and an event recorded after them says when they
have completed; the engine only asks (`query`). On the CPU there is nothing to overlap: the copies run as they are
issued and no event is needed (None). Tests give `KVTiers` copies whose events complete when the test says.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class StreamCopies:
    """Copies on an accelerator's side streams, from and to pinned host memory (asynchronous DMA)."""

    pinned = True

    def __init__(self, device: torch.device):
        self.device = device
        self.streams = {"offload": torch.Stream(device=device), "load": torch.Stream(device=device)}

    @contextmanager
    def on(self, name: str):
        """Queue what runs inside on stream `name`, after the work queued on the engine's stream so far."""
        stream = self.streams[name]
        stream.wait_stream(torch.accelerator.current_stream(self.device))
        with stream:
            yield

    def done(self, name: str) -> torch.Event:
        """An event that completes once what was queued on stream `name` so far has run."""
        event = torch.Event(device=self.device)
        event.record(self.streams[name])
        return event


class SyncCopies:
    """Copies on the CPU: they run as issued."""

    pinned = False

    @contextmanager
    def on(self, name: str):
        yield

    def done(self, name: str) -> None:
        return None
