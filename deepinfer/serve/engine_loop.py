"""The engine's own thread: the only one that touches the LLMEngine.

The HTTP side never calls the engine. It puts work in a thread-safe inbox (`submit` a Job, `abort`
one, `stop`), and the engine thread takes it between steps: it adds the job's prompts as engine
requests (they join the running batch at the next step: continuous batching), aborts what it is
told to (freeing the KV pages at once: LLMEngine.abort), steps the engine while anything is
unfinished, and after each step hands every job what changed (`Update`) through the job's `sink`,
a callable the HTTP side gives (it calls loop.call_soon_threadsafe, so the update lands in the
request's asyncio queue). When nothing is unfinished the thread sleeps on the inbox.

Back-pressure: `max_queue` bounds the sequences waiting for a place in the running batch (a
request's n samples count n: LLMEngine.num_waiting_sequences, plus the jobs still in the inbox).
`submit` refuses a job (QueueFull) that does not fit beside them now, and one bigger than the whole
queue (TooLarge: it never would; the client must split it). A job's
deadline (the request timeout) is checked after every step; a job past it is aborted and told so.
`stop(grace)`: new jobs are refused; running ones get `grace` seconds to finish, then are aborted,
each told so in a final update, and the thread ends.

With expert parallelism every rank runs an EpEngineLoop (deepinfer.serve.ep_loop), which keeps
this class's job bookkeeping and replaces the loop by the ranks' lockstep.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from deepinfer.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.engine.sampling_params import InvalidRequestError
from deepinfer.engine.sequence import SequenceStatus

log = logging.getLogger(__name__)

PENDING = -1  # overlap scheduling's placeholder for a token still in flight (deepinfer.engine.overlap)


class QueueFull(Exception):
    """The engine's waiting queue is at --max-queue: the job was not taken."""


class TooLarge(Exception):
    """The job alone holds more sequences than --max-queue allows to wait: it could never be taken."""


class ShuttingDown(Exception):
    """The server is stopping: the job was not taken."""


@dataclass
class Job:
    """One HTTP request: its engine requests (a completions body may hold several prompts), where its
    updates go, and whether it wants every step's tokens (streaming) or only the end."""

    prompts: list  # (token ids, SamplingParams, text) per prompt, as LLM.make_requests gives them
    sink: Callable[["Update"], None]  # called on the engine thread; must not block
    stream: bool
    deadline: float | None = None  # time.monotonic() past which the job is aborted
    key: int = -1  # set by submit


def job_sequences(job: Job) -> int:
    """The engine sequences a job makes: n per prompt."""
    return sum(params.n for _, params, _ in job.prompts)


@dataclass
class SampleDelta:
    """What one sample (a choice) of one prompt got since the last update."""

    prompt: int  # the prompt's index in the job
    index: int  # the sample's index among the prompt's n
    token_ids: list[int]
    logprobs: list | None  # PositionLogprobs per new token, when asked for
    final: CompletionOutput | None = None  # set once, when the sample finished


@dataclass
class Update:
    """Handed to a job's sink. kind: "tokens" (streaming: new tokens of some samples), "done" (every
    prompt finished: `outputs`, a RequestOutput per prompt), "failed" (the engine refused it:
    `message`), "aborted" (timeout or shutdown: `message`; the deltas before it were sent)."""

    kind: str
    deltas: list[SampleDelta] = field(default_factory=list)
    outputs: list[RequestOutput] | None = None
    message: str = ""
    status: int = 200  # the HTTP status of a failed or aborted job: 400 refused, 408 timeout, 503 shutdown, 500 the engine failed


@dataclass
class _Live:
    job: Job
    heads: list  # the engine's Sequence (sample 0) per prompt
    sent: dict = field(default_factory=dict)  # (prompt, sample) -> tokens already handed out
    closed: set = field(default_factory=set)  # (prompt, sample) whose final delta went out


class EngineLoop:
    """Runs `llm.engine` on its own thread (see the module docstring). metrics: a ServeMetrics, or None."""

    idle_wait_s = 1.0  # how long the idle thread sleeps before looking at deadlines again

    def __init__(self, llm, max_queue: int, metrics=None):
        self.llm = llm
        self.engine = llm.engine
        self.max_queue = max_queue
        self.metrics = metrics
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._live: dict[int, _Live] = {}
        self._next_key = 0
        self._stopping = False  # no new jobs
        self._abort_at: float | None = None  # monotonic time the unfinished jobs get aborted (stop)
        self.num_waiting = 0  # sequences waiting for the running batch, as of the last step
        self.num_running = 0
        self.error: BaseException | None = None  # what killed the thread, if anything did
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)

    # -- the HTTP side --------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> int:
        """Queue `job` for the engine thread; its key (for `abort`). QueueFull / TooLarge / ShuttingDown when it is not taken."""
        size = job_sequences(job)
        if size > self.max_queue:
            raise TooLarge(f"the request makes {size} sequences (prompts times n), more than the server lets wait at once (--max-queue {self.max_queue}); "
                           "split it into smaller requests")  # fmt: skip
        with self._wake:
            if self._stopping or not self.alive:
                raise ShuttingDown("the server is shutting down" if self._stopping else f"the engine stopped: {self.error!r}")
            queued = self.num_waiting + sum(job_sequences(item[1]) for item in self._inbox if item[0] == "add")
            if queued + size > self.max_queue:
                raise QueueFull(f"the server's queue is full ({queued} sequences wait for the engine, --max-queue {self.max_queue}); retry later")
            job.key = self._next_key
            self._next_key += 1
            self._inbox.append(("add", job))
            self._wake.notify()
        return job.key

    def abort(self, key: int) -> None:
        """Drop a job (its client went away): its requests are aborted between steps; no update follows."""
        with self._wake:
            self._inbox.append(("abort", key))
            self._wake.notify()

    def stop(self, grace_s: float) -> None:
        """Refuse new jobs; abort the unfinished ones after `grace_s` seconds (each told so); end the thread."""
        with self._wake:
            self._stopping = True
            self._abort_at = time.monotonic() + grace_s
            self._wake.notify()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def unfinished_jobs(self) -> int:
        with self._wake:
            return len(self._live) + sum(item[0] == "add" for item in self._inbox)

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._take_inbox()
                if self._abort_at is not None and time.monotonic() >= self._abort_at:
                    self._abort_live("the server is shutting down: the request was aborted before it finished", 503)
                if self._stopping and not self._live and not self._inbox:
                    break
                if self._has_work():
                    self._step()
                else:
                    self._idle()
                self._expire()
        except BaseException as exc:  # the engine failed: every waiting client is told, the server reports unhealthy
            self.error = exc
            log.exception("the engine thread failed")
            self._abort_live(f"the engine failed: {type(exc).__name__}: {exc}", 500)
        finally:
            self.engine.flush_tiers()  # blocks copied out but not yet written reach the disk and the shared store
            self._publish_counts()

    def _has_work(self) -> bool:
        return self.engine.has_unfinished()

    def _idle(self) -> None:
        """Sleep until something arrives (or a deadline may have passed)."""
        with self._wake:
            if not self._inbox:
                wait = self.idle_wait_s
                if self._abort_at is not None:
                    wait = max(0.0, min(wait, self._abort_at - time.monotonic()))
                self._wake.wait(wait)

    def _step(self) -> None:
        engine = self.engine
        prompt0, gen0 = engine.num_prompt_tokens_computed, engine.num_generated_tokens
        start = time.perf_counter()
        engine.step()
        if self.metrics is not None:
            self.metrics.step(time.perf_counter() - start, engine.num_prompt_tokens_computed - prompt0, engine.num_generated_tokens - gen0)
        self._publish()

    def _take_inbox(self) -> None:
        with self._wake:
            items = list(self._inbox)
            self._inbox.clear()
        for item in items:
            if item[0] == "add":
                self._add(item[1])
            else:
                self._drop(item[1])
        self._publish_counts()

    def _add(self, job: Job) -> None:
        heads = []
        try:
            for ids, params, text in job.prompts:
                heads.append(self.engine.add_request(ids, params, text))
        except Exception as exc:  # InvalidRequestError: checked off the thread already, the engine has the last word
            for head in heads:
                self.engine.abort(head)
            if isinstance(exc, InvalidRequestError):
                job.sink(Update("failed", message=str(exc), status=400))
                return
            # Anything else is a defect of ours (a RecursionError on a hostile schema killed this thread once):
            # that request fails, the thread goes on serving the others.
            log.exception("the engine could not take a request")
            job.sink(Update("failed", message=f"the engine could not take the request: {type(exc).__name__}: {exc}", status=500))
            return
        self._live[job.key] = _Live(job, heads)

    def _drop(self, key: int) -> None:
        live = self._live.pop(key, None)
        if live is None:
            return
        aborted = [self.engine.abort(head) for head in live.heads]
        if any(aborted) and self.metrics is not None:
            self.metrics.aborted("disconnect")

    def _abort_live(self, message: str, status: int) -> None:
        """Abort every unfinished job, each told `message` (shutdown, or the engine failed)."""
        for key in list(self._live):
            live = self._live.pop(key)
            for head in live.heads:
                try:
                    self.engine.abort(head)
                except Exception:  # the engine is broken: the client is told all the same
                    log.exception("aborting a request failed")
            live.job.sink(Update("aborted", deltas=self._deltas(live), message=message, status=status))
            if self.metrics is not None:
                self.metrics.aborted("shutdown")

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, live in self._live.items() if live.job.deadline is not None and now >= live.job.deadline]:
            self._time_out(key)

    def _time_out(self, key: int) -> None:
        """Abort a job past its deadline, telling it so (408)."""
        live = self._live.pop(key)
        for head in live.heads:
            self.engine.abort(head)
        message = "the request did not finish within the server's --request-timeout; it was aborted"
        live.job.sink(Update("aborted", deltas=self._deltas(live), message=message, status=408))
        if self.metrics is not None:
            self.metrics.aborted("timeout")

    def _publish(self) -> None:
        """After a step: each job's news through its sink."""
        for key in list(self._live):
            live = self._live[key]
            done = all(s.status is SequenceStatus.FINISHED for head in live.heads for s in head.samples)
            deltas = self._deltas(live) if live.job.stream else []
            if done:
                del self._live[key]
                outputs = [self.engine.make_output(head) for head in live.heads]
                live.job.sink(Update("done", deltas=deltas, outputs=outputs))
            elif deltas:
                live.job.sink(Update("tokens", deltas=deltas))
        self._publish_counts()

    def _deltas(self, live: _Live) -> list[SampleDelta]:
        """The tokens each sample got since the last update (those of a step in flight excluded), and
        the final output of each that finished since."""
        deltas = []
        for p, head in enumerate(live.heads):
            output = None
            for sample in head.samples:
                where = (p, sample.sample_index)
                if where in live.closed:
                    continue
                ids = sample.output_token_ids
                end = len(ids)
                while end and ids[end - 1] == PENDING:
                    end -= 1
                start = live.sent.get(where, 0)
                finished = sample.status is SequenceStatus.FINISHED
                if end <= start and not finished:
                    continue
                records = sample.logprobs[start:end] if sample.logprobs is not None else None
                final = None
                if finished:
                    output = output or self.engine.make_output(head)
                    final = output.outputs[sample.sample_index]
                    live.closed.add(where)
                    positions = final.logprobs[start:end] if final.logprobs is not None else None
                else:
                    positions = self._positions(records)
                live.sent[where] = end
                deltas.append(SampleDelta(p, sample.sample_index, list(ids[start:end]), positions, final))
        return deltas

    def _positions(self, records):
        if records is None:
            return None
        from deepinfer.engine.logprobs import position_logprobs

        return [position_logprobs(r, self.engine.tokenizer) for r in records]

    def _publish_counts(self) -> None:
        scheduler = self.engine.scheduler
        self.num_waiting = self.engine.num_waiting_sequences()
        self.num_running = len(scheduler.running)
        if self.metrics is not None:
            blocks = self.engine.block_manager
            self.metrics.engine_state(self.num_running, self.num_waiting, 1.0 - blocks.num_free_blocks / blocks.num_blocks)
            if self.engine.tiers is not None:
                self.metrics.kv_tiers(self.engine.tiers.stats())
