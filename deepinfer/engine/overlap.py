"""Overlap scheduling: the host schedules and launches decode step n+1 while the device runs step n.

Run one at a time, a decode step is: schedule, build the inputs, launch, wait for the tokens, append
them and check the stops; the device idles through everything but the launch (on the H200, 0.4-1.6 ms
of a 2-8 ms step: docs/performance.md). Overlapped, step n+1 is scheduled, built and queued behind
step n before step n's tokens are waited for; each sequence's newest token, which step n+1 takes as
input and the host does not know yet, is copied from step n's output on the device, and step n's
tokens reach the host (a copy queued behind it) while step n+1 runs.

What the host cannot know when it launches step n+1:
- whether a sequence stops at step n on EOS, a stop token or a stop string: it runs in step n+1 all
  the same, and that row is dropped (its KV lands past the sequence's end, in pages freed with it,
  before any later step can reuse them: one device queue keeps the order);
- whether a waiting request would fit once step n's stops free their pages: it is admitted one step
  later than without overlap.
Sequences that step n ends by length (max_tokens, the model's length) are known and left out.

Only decode follows decode ahead of time: a step that prefills (a prompt chunk, an admission) or that
would have to preempt a sequence waits for the step in flight first, and is scheduled as without
overlap. A sequence's tokens are the same either way, except where a different batch composition
moves its logits (default mode: as with any batching; deterministic mode: never). Speculative
decoding and expert parallelism step without it (their steps wait for their tokens).

Structured output: a step's grammar masks are filled on the host from each matcher, which must have
consumed the step before's token first; but only the sampling needs them, not the forward. So a
decode step with a grammar row goes ahead in two halves: its forward is launched behind step n (its
logits stay on the device, ModelRunner.launch_forward), then step n is finished (its tokens advance
the matchers), then step n+1's masks are filled and its sampling is queued behind its forward
(ModelRunner.sample_pending). The device runs step n+1's forward while the host waits for step n,
feeds the matchers and fills the masks. A sequence that step n stops (its grammar complete or
failed included) still has its row in step n+1: that row gets an all-ones mask and no penalty slot
(deepinfer.engine.logits_processing), and its token is dropped. Requests waiting for their grammar
join through a prefill step, which waits for the step in flight as any prefill does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine.logprobs import LogprobRows
from deepinfer.engine.model_runner import LaunchedStep
from deepinfer.engine.parallel_samples import finished_requests
from deepinfer.engine.scheduler import ScheduledBatch
from deepinfer.engine.sequence import Sequence, SequenceStatus

PENDING = -1  # a token id in seq.token_ids while the step that samples it is in flight


@dataclass
class InFlight:
    """A launched decode step whose tokens the host has not read yet."""

    samplers: list[Sequence]
    tokens: torch.Tensor  # on the device, one per sampler
    host: torch.Tensor  # the same, copied to host memory once `copied` has passed
    copied: torch.Event | None  # None: the copy was synchronous
    positions: list[int]  # where each sampler's token goes in its token_ids
    rows: dict[int, int]  # seq_id -> its row in `tokens`
    logprobs: LogprobRows | None = None  # the samplers' logprobs that asked, copied to the host with the tokens


class OverlapScheduler:
    """Drives `LLMEngine.step` one decode step ahead (see the module docstring)."""

    def __init__(self, engine, async_copies: bool):
        """async_copies: the device runs behind the host (pinned host buffers and events for the
        tokens' copies); False on the CPU, where every launch has already run (tests)."""
        self.engine = engine
        self.async_copies = async_copies
        self.in_flight: InFlight | None = None
        self.steps_ahead = 0  # steps launched behind one in flight

    def step(self) -> list[Sequence]:
        """Launch the next step behind the one in flight when it may go ahead, then finish the one
        in flight. Returns the requests that finished, by their sample 0 (none on a step that only launched)."""
        engine = self.engine
        previous, self.in_flight = self.in_flight, None
        if previous is not None and not any(seq.status is SequenceStatus.RUNNING for seq in previous.samplers):
            previous = None  # every sequence in it stopped the step before: nothing to read
        if previous is None:
            batch = engine.schedule()
            if batch is None:  # (KV tiers: nothing can run this step)
                return []
            engine.before_step()
            if batch.is_prefill:
                return engine.execute(batch)
            self.in_flight = self._launch(batch, None)
            return []
        leaving = {seq.seq_id for seq, at in zip(previous.samplers, previous.positions) if engine.ends_by_length(seq, at + 1)}
        batch = engine.scheduler.schedule_decode_ahead(leaving)
        if batch is None:
            return self._finish(previous)
        engine.before_step()
        self.steps_ahead += 1
        if not any(seq.grammar is not None for seq in batch.seqs):
            self.in_flight = self._launch(batch, previous)
            return self._finish(previous)
        # the masks need step n's tokens in the matchers: only the forward goes ahead of them
        pending = engine.runner.launch_forward(batch, self._inputs_from(batch, previous))
        finished = self._finish(previous)
        self.in_flight = self._record(engine.runner.sample_pending(pending))
        return finished

    def drop(self) -> None:
        """Forget the step in flight (its requests were aborted; the device finishes it unread)."""
        self.in_flight = None

    def _launch(self, batch: ScheduledBatch, previous: InFlight | None) -> InFlight:
        inputs_from = self._inputs_from(batch, previous) if previous is not None else None
        return self._record(self.engine.runner.launch(batch, inputs_from=inputs_from))

    @staticmethod
    def _inputs_from(batch: ScheduledBatch, previous: InFlight) -> tuple[list[int], list[int], torch.Tensor]:
        """ModelRunner.launch's inputs_from: each sequence's input is its token from the step in flight."""
        rows = [row for row, seq in enumerate(batch.seqs) if seq.token_ids[seq.num_computed_tokens] == PENDING]
        return rows, [previous.rows[batch.seqs[row].seq_id] for row in rows], previous.tokens

    def _record(self, launched: LaunchedStep) -> InFlight:
        """A launched step in flight: its tokens' (and logprobs') copies to the host queued behind
        it, a pending token appended to each sampler still running."""
        samplers, tokens = launched.samplers, launched.tokens
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=self.async_copies)
        host.copy_(tokens, non_blocking=self.async_copies)
        logprobs = launched.logprobs.to_host(pinned=self.async_copies) if launched.logprobs is not None else None
        copied = None
        if self.async_copies:
            copied = torch.Event(device=tokens.device)
            copied.record()
        positions = []
        for seq in samplers:
            positions.append(seq.num_tokens)
            if seq.status is SequenceStatus.RUNNING:  # else it stopped at the step before (its row is dropped)
                # a prefix-hit snapshot of the state this step leaves, if a block boundary: copied now, before the next step runs
                self.engine.scheduler.block_manager.note_launched(seq, seq.num_computed_tokens + 1)
                seq.num_computed_tokens += 1  # its input is in the cache once the step has run
                seq.token_ids.append(PENDING)
        return InFlight(samplers, tokens, host, copied, positions, {seq.seq_id: row for row, seq in enumerate(samplers)}, logprobs)

    def _finish(self, step: InFlight) -> list[Sequence]:
        """Step's tokens into their sequences, the stops checked; a sequence that stops drops the
        token a later step in flight holds for it."""
        engine = self.engine
        if step.copied is not None:
            step.copied.synchronize()
        finished = []
        records = dict(step.logprobs.records()) if step.logprobs is not None else {}
        for row, (seq, token, at) in enumerate(zip(step.samplers, step.host.tolist(), step.positions)):
            if seq.status is not SequenceStatus.RUNNING:  # it stopped at the step before this one
                continue
            seq.token_ids[at] = token
            if row in records:
                seq.add_logprobs(records[row])
            engine.scheduler.block_manager.commit(seq, at - 1, at)  # prefix cache: blocks of known tokens only
            engine.num_generated_tokens += 1
            if engine._check_stop(seq, token, at + 1):
                del seq.token_ids[at + 1 :]
                engine.scheduler.finish(seq)
                finished.append(seq)
        return finished_requests(finished)
