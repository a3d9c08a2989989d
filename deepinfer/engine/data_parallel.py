"""Attention data parallelism: every rank runs its own requests, the MoE layers span all ranks.

With expert parallelism over W ranks (one process per device, started by torchrun), each rank
holds a full copy of everything but the routed experts, and its own KV cache. Requests are dealt
round-robin by input index (request i runs on rank i mod W). Every step, every rank runs one
forward in lockstep, because the MoE layers' dispatch / combine are collectives: a rank without
work runs an empty one (`LLMEngine.idle_step`). Each rank schedules its step first; then one tiny
all_reduce sums (has work, finished results, cannot replay a CUDA graph, prompt tokens computed
and tokens generated so far (rank 0's progress bar shows the totals), the graph size each would
replay, one-hot) over the ranks: a step is a CUDA-graph step when no rank needs an eager one,
and then every rank replays the graph of the largest size among them (an idle rank with padding
rows only), captured by all ranks together the first time; the run ends when no rank has work, and finished
results are gathered to rank 0 (torch.distributed.gather_object) in the step after they finish,
so rank 0 can write them while the run goes on. Only rank 0 yields results.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch
import torch.distributed as dist

from deepinfer.distributed.group import DistContext, DistributedError, PeerFailure, _first_line
from deepinfer.engine.llm import GenerationStream
from deepinfer.engine.outputs import RequestOutput

log = logging.getLogger(__name__)

# The per-step all_reduce: has work, finished results, cannot replay, prompt tokens, generated
# tokens; then one slot per CUDA-graph size.
STEP_FLAGS = 5


def my_requests(num_requests: int, ctx: DistContext) -> list[int]:
    """The input indices this rank runs: round-robin by index."""
    return list(range(ctx.rank, num_requests, ctx.world_size))


def collective_failure(ctx: DistContext, what: str, exc: BaseException) -> DistributedError:
    """A one-line error for a collective that failed: a rank died, or it timed out."""
    if isinstance(exc, DistributedError):
        return exc
    return PeerFailure(
        f"rank {ctx.rank} of {ctx.world_size}: {what} failed ({type(exc).__name__}: {_first_line(exc)}); "
        f"another rank died or stopped answering within the timeout of {ctx.timeout_s:g} s (--dist-timeout)"
    )


def is_collective_error(exc: BaseException) -> bool:
    """Errors that come from the process group rather than from this rank's own computation."""
    if isinstance(exc, DistributedError):
        return True
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc)
    markers = ("gloo", "Gloo", "NCCL", "HCCL", "Connection closed", "Connection reset", "Broken pipe", "timed out", "Timed out")
    return isinstance(exc, RuntimeError) and any(m in text for m in markers)


class DataParallelStream(GenerationStream):
    """Iterates (input index, RequestOutput) on rank 0 as requests finish on any rank; yields
    nothing on the other ranks. Every rank must iterate it to the end (the steps are collective).
    The iterator protocol is GenerationStream's; the steps (`_run`) are collective."""

    def __init__(self, engine, ctx: DistContext, position: dict[int, int], num_requests: int, use_tqdm: bool, *, queued: int | None = None):
        self.engine = engine
        self.ctx = ctx
        self.position = position  # seq_id -> input index, for this rank's requests
        self.num_requests = num_requests
        self.queued = num_requests if queued is None else queued  # requests over all ranks (the bar's total)
        self.use_tqdm = use_tqdm and ctx.rank == 0
        self._iterator = self._run()

    def _collective(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise collective_failure(self.ctx, what, exc) from exc

    def _run(self) -> Iterator[tuple[int, RequestOutput]]:
        from deepinfer.engine.progress import Progress

        engine, ctx = self.engine, self.ctx
        device = engine.runtime.device if ctx.backend != "gloo" else torch.device("cpu")
        progress = Progress(self.queued, self.use_tqdm)
        prompt0, gen0 = engine.num_prompt_tokens_computed, engine.num_generated_tokens
        finished: list[tuple[int, RequestOutput]] = []  # this rank's, not gathered yet
        try:
            while True:
                batch = engine.schedule() if engine.has_unfinished() else None
                buckets = engine.ep_graph_buckets or []
                mine = engine.graph_bucket(batch) if buckets else None
                flags = torch.zeros(STEP_FLAGS + len(buckets), dtype=torch.int64)
                flags[:STEP_FLAGS] = torch.tensor([
                    int(batch is not None), len(finished), int(not engine.replayable(batch)),
                    engine.num_prompt_tokens_computed - prompt0, engine.num_generated_tokens - gen0,
                ])  # fmt: skip
                if mine is not None:
                    flags[STEP_FLAGS + mine] = 1
                flags = flags.to(device)
                self._collective("the per-step all_reduce of work flags", dist.all_reduce, flags, group=ctx.group)
                flags = flags.tolist()
                ranks_with_work, num_finished, ranks_not_replayable, prompt_tokens, generated_tokens = flags[:STEP_FLAGS]
                # A CUDA-graph step only when every rank can replay (or is idle): then every rank replays
                # the graph of the largest batch among them (idle ranks: padding only), so the
                # dispatches share its token bound and the buffers captured with it.
                used = [i for i, n in enumerate(flags[STEP_FLAGS:]) if n]
                graph_size = buckets[max(used)] if used and ranks_not_replayable == 0 else 0
                if num_finished:
                    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
                    self._collective("gathering finished results to rank 0", dist.gather_object, finished, gathered, dst=0, group=ctx.group)
                    finished = []
                    if ctx.rank == 0:
                        results = sorted((item for part in gathered for item in part), key=lambda item: item[0])
                        progress.update(len(results), prompt_tokens, generated_tokens)
                        yield from results
                if self.use_tqdm:
                    progress.update(0, prompt_tokens, generated_tokens)  # totals over the ranks, up to the last step
                if not ranks_with_work:
                    break
                try:
                    if graph_size:
                        engine.ensure_graph(graph_size)  # every rank, the same size: new graphs pair up
                    if batch is not None:
                        engine.before_step()
                        done = engine.execute(batch, graph_size)
                        finished.extend((self.position[seq.seq_id], engine.make_output(seq)) for seq in done)
                    else:
                        engine.idle_step(graph_size)  # joins the MoE collectives with an empty batch
                except Exception as exc:
                    if is_collective_error(exc):
                        raise collective_failure(ctx, "a model step", exc) from exc
                    raise
        finally:
            engine.abort_all()
            progress.close()
