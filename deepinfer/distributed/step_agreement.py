"""What the ranks of an expert-parallel run agree on before each step (attention data parallel).

Every rank runs its own requests, but the MoE layers' dispatch / combine are collectives, so every
rank runs one forward per step in lockstep. Each rank schedules its step first and says what it
brings (`RankStep`); one tiny all_reduce sums that over the ranks (int64 flags: has work, finished
results not gathered yet, cannot replay a device graph, prompt tokens computed, tokens generated,
has unfinished requests; then one slot per graph size, one-hot: the smallest graph that holds its
batch). From the sums every rank derives the same decision (`AgreedStep`):

- the run ends when no rank has unfinished requests; a step where none has work but some have
  unfinished ones (requests loading their prefix from a KV tier) runs no forward: each rank waits
  for its own loads;
- a step is a device-graph step only when no rank needs an eager one (a prefill anywhere makes it
  eager), and then every rank replays the graph of the LARGEST size among them, so that the
  dispatches share its token bound and the buffers captured with it (an idle rank replays it with
  padding rows only);
- finished results are gathered to rank 0 (`gather_object`) in the step after they finish, so rank
  0 can write them while the run goes on; the token counts are rank 0's progress bar totals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.distributed.group import DistContext, collective_failure

# The flags before the graph sizes: has work, finished results, cannot replay, prompt tokens,
# generated tokens, has unfinished requests.
STEP_FLAGS = 6


@dataclass(frozen=True)
class RankStep:
    """What one rank brings to a step."""

    has_work: bool  # it scheduled a batch (False: it runs an idle step)
    num_finished: int  # its finished results not gathered to rank 0 yet
    replayable: bool  # its step can join a device-graph step (an idle one always can)
    graph_bucket: int | None  # index of the smallest graph that holds its batch (None: idle, eager, or no graphs)
    prompt_tokens: int  # prompt tokens it computed since the run started
    generated_tokens: int  # tokens it generated since the run started
    unfinished: bool = False  # it has requests not finished (it may have no work this step: they load from a KV tier)


@dataclass(frozen=True)
class AgreedStep:
    """The step every rank runs, the same on every rank."""

    ranks_with_work: int  # 0: the run is over
    num_finished: int  # results to gather to rank 0 now
    graph_size: int  # the graph every rank replays; 0: an eager step
    prompt_tokens: int  # over all ranks, since the run started
    generated_tokens: int
    ranks_unfinished: int = 0  # 0 (and no rank with work): the run is over


def encode(step: RankStep, num_buckets: int) -> torch.Tensor:
    """One rank's flags [STEP_FLAGS + num_buckets] (int64), to be summed over the ranks."""
    flags = torch.zeros(STEP_FLAGS + num_buckets, dtype=torch.int64)
    flags[:STEP_FLAGS] = torch.tensor([
        int(step.has_work), step.num_finished, int(not step.replayable), step.prompt_tokens, step.generated_tokens, int(step.unfinished or step.has_work),
    ])  # fmt: skip
    if step.graph_bucket is not None:
        flags[STEP_FLAGS + step.graph_bucket] = 1
    return flags


def decide(summed: list[int], graph_sizes: list[int]) -> AgreedStep:
    """The step the summed flags of all ranks call for (every rank computes the same)."""
    ranks_with_work, num_finished, ranks_not_replayable, prompt_tokens, generated_tokens, ranks_unfinished = summed[:STEP_FLAGS]
    used = [i for i, n in enumerate(summed[STEP_FLAGS:]) if n]
    graph_size = graph_sizes[max(used)] if used and ranks_not_replayable == 0 else 0
    return AgreedStep(ranks_with_work, num_finished, graph_size, prompt_tokens, generated_tokens, ranks_unfinished)


class StepAgreement:
    """The collectives of a step's agreement over the ranks of `ctx`. graph_sizes: the device
    graphs' batch sizes, the same list on every rank (empty: every step eager); device: where the
    flags travel (the CPU for gloo)."""

    def __init__(self, ctx: DistContext, graph_sizes: list[int], device: torch.device):
        self.ctx = ctx
        self.graph_sizes = list(graph_sizes)
        self.device = device

    def agree(self, mine: RankStep) -> AgreedStep:
        """Sum every rank's flags (one all_reduce) and decide the step."""
        flags = encode(mine, len(self.graph_sizes)).to(self.device)
        self._collective("the per-step all_reduce of work flags", dist.all_reduce, flags, group=self.ctx.group)
        return decide(flags.tolist(), self.graph_sizes)

    def gather_finished(self, finished: list[tuple[int, object]]) -> list[tuple[int, object]]:
        """Every rank's (input index, result) pairs on rank 0, by input index; [] on the others.
        Called by every rank in a step whose agreement counted finished results."""
        gathered = [None] * self.ctx.world_size if self.ctx.rank == 0 else None
        self._collective("gathering finished results to rank 0", dist.gather_object, finished, gathered, dst=0, group=self.ctx.group)
        if self.ctx.rank != 0:
            return []
        return sorted((item for part in gathered for item in part), key=lambda item: item[0])

    def _collective(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise collective_failure(self.ctx, what, exc) from exc
