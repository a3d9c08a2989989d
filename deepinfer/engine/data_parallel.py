"""Attention data parallelism: every rank runs its own requests, the MoE layers span all ranks.

With expert parallelism over W ranks (one process per device, started by torchrun), each rank
holds a full copy of everything but the routed experts, and its own KV cache. Requests are dealt
round-robin by input index (request i runs on rank i mod W). Every step, every rank runs one
forward in lockstep, because the MoE layers' dispatch / combine are collectives: a rank without
work runs an empty one. Each step: this rank schedules its batch, the ranks agree on the step
(deepinfer.distributed.step_agreement: one all_reduce; results finished anywhere are gathered to
rank 0), and this rank runs its part of it (deepinfer.distributed.lockstep). Only rank 0 yields
results; the run ends when no rank has work.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch

from deepinfer.distributed.group import DistContext, collective_failure, is_collective_error
from deepinfer.distributed.lockstep import LockstepRunner
from deepinfer.distributed.step_agreement import StepAgreement
from deepinfer.engine.llm import GenerationStream, StepResults

log = logging.getLogger(__name__)


def my_requests(num_requests: int, ctx: DistContext) -> list[int]:
    """The input indices this rank runs: round-robin by index."""
    return list(range(ctx.rank, num_requests, ctx.world_size))


class DataParallelStream(GenerationStream):
    """Iterates (input index, RequestOutput) on rank 0 as requests finish on any rank; yields
    nothing on the other ranks. Every rank must iterate it to the end (the steps are collective).
    What it adds to GenerationStream: the steps (`_steps`) run in lockstep with the other ranks, and
    rank 0's bar shows the totals of all ranks."""

    def __init__(self, engine, ctx: DistContext, position: dict[int, int], num_requests: int, use_tqdm: bool, *, queued: int | None = None):
        """position: seq_id -> input index, for this rank's requests; queued: requests over all
        ranks (the bar's total)."""
        super().__init__(engine, position, num_requests, use_tqdm and ctx.rank == 0, queued=queued)
        self.ctx = ctx
        self.lockstep = LockstepRunner(engine)
        device = engine.runtime.device if ctx.backend != "gloo" else torch.device("cpu")
        self.agreement = StepAgreement(ctx, self.lockstep.graph_sizes, device)

    def _steps(self) -> Iterator[StepResults]:
        engine, ctx = self.engine, self.ctx
        prompt0, gen0 = engine.num_prompt_tokens_computed, engine.num_generated_tokens
        finished: list = []  # this rank's (input index, RequestOutput), not gathered yet
        while True:
            batch = engine.schedule() if engine.has_unfinished() else None
            mine = self.lockstep.propose(batch, len(finished), engine.num_prompt_tokens_computed - prompt0, engine.num_generated_tokens - gen0)
            step = self.agreement.agree(mine)
            gathered = []
            if step.num_finished:
                gathered = self.agreement.gather_finished(finished)  # rank 0: every rank's, by input index
                finished = []
            yield StepResults(gathered, step.prompt_tokens, step.generated_tokens)
            if not step.ranks_unfinished:
                break
            if not step.ranks_with_work:  # every unfinished request loads its prefix from a KV tier: no forward
                engine.wait_for_tiers()
                continue
            try:
                done = self.lockstep.run(batch, step.graph_size)
                finished.extend((self.position[seq.seq_id], engine.make_output(seq)) for seq in done)
            except Exception as exc:
                if is_collective_error(exc):
                    raise collective_failure(ctx, "a model step", exc) from exc
                raise
