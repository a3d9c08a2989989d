"""The engine loop of `deepinfer serve --ep N`: rank 0 serves HTTP, every rank steps.

With expert parallelism each rank runs its own requests through its own engine (attention data
parallel) and the MoE layers exchange tokens, so the ranks step in lockstep (idle ranks run idle
steps: deepinfer.engine.data_parallel). Every rank runs one EpEngineLoop; rank 0's is the server's
(its thread, its inbox: `submit`, `abort`, `stop` as in EngineLoop), the others' run in their main
thread (`run_rank`). Each turn of the loop, on every rank:

1. rank 0 turns its inbox into orders and broadcasts them (`broadcast_object_list`): add a job on
   rank r (the rank with the fewest engine requests of live jobs, ties taken in turn), drop one (its
   client went away), time one out (rank 0 holds the deadlines), abort all (shutdown), stop. While
   no job is live anywhere rank 0 waits for its inbox up to a heartbeat (1 s, or a quarter of
   --dist-timeout when that is shorter) and broadcasts even an empty order list, so the other
   ranks, waiting in the broadcast, never reach the collective timeout;
2. each rank applies the orders that name it (EngineLoop's `_add`, `_drop`, `_time_out`,
   `_abort_live`: a job's updates go to this rank's outbox instead of an HTTP queue);
3. each rank schedules its batch and the ranks agree on the step (StepAgreement: one all_reduce on
   the run's process group); when some rank has work, every rank runs its part
   (LockstepRunner) and computes its jobs' updates (EngineLoop's `_publish`);
4. every rank's outbox and its engine counts are gathered to rank 0 (`gather_object`), which hands
   each update to its job's sink (the request's asyncio queue) and sets the metrics (sums over the
   ranks, and the per-rank gauges).

So a streamed token reaches rank 0 in the step that made it, and an abort reaches the owning rank
before the next step. The orders and reports travel on a gloo group of their own (objects, off the
model's device path); the step agreement uses the run's group as run-batch's ranks do. A rank whose
collective fails ends its loop with the error: on rank 0 every live request is told (500) and the
server exits (the launcher reports the failing rank).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer.distributed.group import DistContext, collective_failure, is_collective_error
from deepinfer.distributed.lockstep import LockstepRunner
from deepinfer.distributed.step_agreement import StepAgreement
from deepinfer.errors import UserError
from deepinfer.serve.engine_loop import EngineLoop, Job, Update

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0


def control_group(ctx: DistContext):
    """The gloo group the orders and reports travel on (every rank calls this once, in the same order)."""
    if ctx.backend == "gloo":
        return ctx.group
    try:
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=ctx.timeout_s))
    except Exception as exc:
        raise collective_failure(ctx, "forming the serving ranks' gloo group", exc) from exc


class EpEngineLoop(EngineLoop):
    """One rank's engine loop of an expert-parallel server (module docstring). metrics: rank 0's
    ServeMetrics (None on the other ranks); group: control_group(ctx)."""

    def __init__(self, llm, max_queue: int, metrics=None, *, ctx: DistContext, group):
        super().__init__(llm, max_queue, metrics=None)  # EngineLoop's own metric calls stay silent: rank 0 counts from the reports
        self.serve_metrics = metrics
        self.ctx = ctx
        self.group = group
        self.first = ctx.rank == 0
        self.heartbeat_s = min(HEARTBEAT_S, ctx.timeout_s / 4)
        self.lockstep = LockstepRunner(self.engine)
        device = self.engine.runtime.device if ctx.backend != "gloo" else torch.device("cpu")
        self.agreement = StepAgreement(ctx, self.lockstep.graph_sizes, device)
        self._outbox: list[tuple[int, Update]] = []  # this rank's (job key, update) since the last report
        self._jobs: dict[int, tuple[Job, int]] = {}  # rank 0: every live job and the rank that runs it
        self._next_rank = 0  # rank 0: where a tie between equally loaded ranks goes
        self._step_seconds: float | None = None  # this turn's forward, if one ran
        self._tokens_seen = (0, 0)  # rank 0: prompt and generated tokens over all ranks, as counted in the metrics

    # -- the HTTP side (rank 0) -----------------------------------------------------------------

    def unfinished_jobs(self) -> int:
        with self._wake:
            return len(self._jobs) + sum(item[0] == "add" for item in self._inbox)

    def run_rank(self) -> None:
        """A rank other than 0: run the loop in this thread until rank 0 says stop; raise what ended it otherwise."""
        self._run()
        if self.error is not None:
            raise self.error

    # -- every rank -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                orders, stop = self._broadcast(*(self._orders() if self.first else (None, None)))
                self._apply(orders)
                if stop:
                    break
                self._lockstep_step()
                self._report()
        except BaseException as exc:
            self.error = exc
            if self.first:
                if isinstance(exc, UserError):  # a collective broke (a rank died, a timeout): its one line is the story
                    log.error("the engine loop of rank 0 failed: %s", exc)
                else:
                    log.exception("the engine loop of rank 0 failed")
                self._fail_jobs(f"the engine failed: {type(exc).__name__}: {exc}")
            else:
                log.info("the engine loop of rank %d ended: %s", self.ctx.rank, exc)

    def _broadcast(self, orders, stop):
        box = [(orders, stop)]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except Exception as exc:
            raise collective_failure(self.ctx, "broadcasting rank 0's orders", exc) from exc
        return box[0]

    def _apply(self, orders: list) -> None:
        me = self.ctx.rank
        for order in orders:
            kind = order[0]
            if kind == "add" and order[1] == me:
                _, _, key, prompts, stream = order
                self._add(Job(prompts, self._sink(key), stream, None, key))
            elif kind == "drop" and order[1] == me:
                self._drop(order[2])
            elif kind == "time_out" and order[1] == me and order[2] in self._live:
                self._time_out(order[2])
            elif kind == "abort_all":
                self._abort_live(order[1], order[2])

    def _sink(self, key: int):
        return lambda update: self._outbox.append((key, update))

    def _lockstep_step(self) -> None:
        engine = self.engine
        self._step_seconds = None  # no forward this turn
        batch = engine.schedule() if engine.has_unfinished() else None
        mine = self.lockstep.propose(batch, 0, engine.num_prompt_tokens_computed, engine.num_generated_tokens)
        step = self.agreement.agree(mine)
        if not step.ranks_with_work:
            if step.ranks_unfinished:  # every unfinished request loads its prefix from a KV tier: no forward
                engine.wait_for_tiers()
            return
        start = time.perf_counter()
        try:
            self.lockstep.run(batch, step.graph_size)
        except Exception as exc:
            if is_collective_error(exc):
                raise collective_failure(self.ctx, "a model step", exc) from exc
            raise
        self._step_seconds = time.perf_counter() - start
        self._publish()

    def _report(self) -> None:
        """This rank's updates and engine counts to rank 0 (every turn: they are the metrics too)."""
        engine = self.engine
        blocks = engine.block_manager
        counts = (len(engine.scheduler.running), engine.num_waiting_sequences(), blocks.num_blocks - blocks.num_free_blocks,
                  blocks.num_blocks, engine.num_prompt_tokens_computed, engine.num_generated_tokens)  # fmt: skip
        mine, self._outbox = (self._outbox, counts), []
        gathered = [None] * self.ctx.world_size if self.first else None
        try:
            dist.gather_object(mine, gathered, dst=0, group=self.group)
        except Exception as exc:
            raise collective_failure(self.ctx, "gathering the ranks' updates to rank 0", exc) from exc
        if not self.first:
            return
        for updates, _ in gathered:
            for key, update in updates:
                self._deliver(key, update)
        self.num_running = sum(c[0] for _, c in gathered)
        self.num_waiting = sum(c[1] for _, c in gathered)
        if self.serve_metrics is not None:
            if self._step_seconds is not None:
                prompt, generated = sum(c[4] for _, c in gathered), sum(c[5] for _, c in gathered)  # since the engines started
                self.serve_metrics.step(self._step_seconds, prompt - self._tokens_seen[0], generated - self._tokens_seen[1])
                self._tokens_seen = (prompt, generated)
            used, total = sum(c[2] for _, c in gathered), sum(c[3] for _, c in gathered)
            self.serve_metrics.engine_state(self.num_running, self.num_waiting, used / total)
            for rank, (_, c) in enumerate(gathered):
                self.serve_metrics.rank_state(rank, c[0], c[1], c[2] / c[3])

    def _publish_counts(self) -> None:
        """Nothing here: rank 0 sets the counts from every rank's report (`_report`)."""

    # -- rank 0 ---------------------------------------------------------------------------------

    def _orders(self) -> tuple[list, bool]:
        """The inbox as orders for the ranks, the deadlines and the shutdown's aborts; and whether to stop."""
        with self._wake:
            if not self._inbox and not self._jobs and not self._stopping:
                self._wake.wait(self.heartbeat_s)
            items = list(self._inbox)
            self._inbox.clear()
            stopping = self._stopping
        orders = []
        for kind, item in items:
            if kind == "add":
                rank = self._pick_rank(item)
                self._jobs[item.key] = (item, rank)
                orders.append(("add", rank, item.key, item.prompts, item.stream))
            elif item in self._jobs:  # an abort: its client went away; no update follows
                _, rank = self._jobs.pop(item)
                orders.append(("drop", rank, item))
                if self.serve_metrics is not None:
                    self.serve_metrics.aborted("disconnect")
        now = time.monotonic()
        for key, (job, rank) in self._jobs.items():
            if job.deadline is not None and now >= job.deadline:
                orders.append(("time_out", rank, key))
        if self._abort_at is not None and now >= self._abort_at and self._jobs:
            orders.append(("abort_all", "the server is shutting down: the request was aborted before it finished", 503))
        return orders, stopping and not self._jobs

    def _pick_rank(self, job: Job) -> int:
        """The rank with the fewest engine requests (samples) of live jobs; ties in turn."""
        world = self.ctx.world_size
        load = [0] * world
        for live, rank in self._jobs.values():
            load[rank] += sum(params.n for _, params, _ in live.prompts)
        rank = min(((self._next_rank + i) % world for i in range(world)), key=lambda r: load[r])
        self._next_rank = (rank + 1) % world
        return rank

    def _deliver(self, key: int, update: Update) -> None:
        entry = self._jobs.get(key)
        if entry is None:  # dropped (its client went away) after the rank made the update
            return
        if update.kind != "tokens":
            del self._jobs[key]
            if update.kind == "aborted" and self.serve_metrics is not None:
                self.serve_metrics.aborted("timeout" if update.status == 408 else "shutdown")
        entry[0].sink(update)

    def _fail_jobs(self, message: str) -> None:
        """Tell every live job, and every one still in the inbox, that the engine failed."""
        with self._wake:
            waiting = [item for kind, item in self._inbox if kind == "add"]
            self._inbox.clear()
        for job in [job for job, _ in self._jobs.values()] + waiting:
            job.sink(Update("aborted", message=message, status=500))
        self._jobs.clear()
