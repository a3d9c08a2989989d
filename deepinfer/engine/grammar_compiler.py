"""GrammarCompiler: a request's structured_outputs compiled into an llguidance matcher off the engine
thread, each (kind, spec, options) once, small grammars first.

- The tokenizer's grammar view: llguidance's tokenizer, built once from the checkpoint's
  tokenizer.json with the model's vocabulary size and the engine's EOS ids as llguidance's EOS (so
  a mask allows EOS exactly where the grammar may end). `prepare` builds it on a thread of its own;
  it holds the GIL while it builds (about a second for a 129k vocabulary), so `deepinfer serve`
  calls it at start-up, before it takes requests; elsewhere the first structured request does.
- Each grammar: turned into llguidance's grammar text and checked in a child process
  (deepinfer.engine.grammar_sandbox: a grammar that crashes llguidance takes only the child down),
  then compiled against the tokenizer on a compile thread whose stack is STACK_MARGIN times the
  child's. A grammar that matches nothing (incomplete where it starts, and its first mask allows
  no token but EOS) fails here, with that said.
- Order: COMPILE_THREADS threads take the smallest pending grammar first (by its spec's bytes,
  StructuredOutputsParams.size), and grammars over SMALL_GRAMMAR_BYTES never hold every thread: a
  small grammar never waits behind large ones, whoever sent them. A compile that no request waits
  for any more (they were aborted or timed out) is dropped before it starts.
- Cache: by StructuredOutputsParams.key(); the `cache_size` most recently used grammars are kept
  (EngineConfig.grammar_cache_size); a request holds its own grammar, evicted or not. What is
  compiled is an LLMatcher, kept unused as a template; each sequence gets a deep copy.
- Lifetime: the compile threads hold the queue, not the compiler: a compiler nobody uses any more
  is freed (its tokenizer, ~100 MB, with it), and its threads and child processes end.

A compile error becomes a GrammarError with llguidance's message on one line.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

from deepinfer.engine.grammar_sandbox import SANDBOX_STACK_BYTES, STACK_MARGIN, GrammarSandbox
from deepinfer.engine.grammar_source import GrammarError, compiler_failed, one_line
from deepinfer.engine.sampling_params import InvalidRequestError
from deepinfer.engine.structured_params import StructuredOutputsParams

COMPILE_THREADS = 2  # grammar compilations at a time (llguidance releases the GIL while it builds one)
SMALL_GRAMMAR_BYTES = 16 << 10  # a spec this small (a regex, a short choice list, a usual schema) is never queued behind larger ones
COMPILE_STACK_BYTES = SANDBOX_STACK_BYTES * STACK_MARGIN  # reserved address space; only what the recursion touches is used


def build_ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids):
    """llguidance's tokenizer for the checkpoint's (the second or so `prepare` moves off the engine thread)."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids))


def matches_nothing(matcher, eos_token_ids) -> bool:
    """Whether a fresh matcher's grammar has no output at all: it is incomplete, and its first mask
    allows no token but EOS (llguidance lets a dead grammar end rather than allow nothing)."""
    if matcher.is_accepting():
        return False
    allowed = int.from_bytes(matcher.deep_copy().compute_bitmask(), "little")  # bit t: token t
    for eos in eos_token_ids:
        allowed &= ~(1 << eos)
    return allowed == 0


@dataclass(frozen=True)
class _Target:
    """What a compile needs besides its spec: the tokenizer (a future), the EOS ids, the time limit."""

    ll_tokenizer: Future
    eos_token_ids: list[int]
    timeout_s: float

    def compile(self, spec: StructuredOutputsParams, sandbox: GrammarSandbox):
        """spec's template matcher; GrammarError when it does not compile (module docstring)."""
        import llguidance

        grammar = sandbox.translate(spec, self.timeout_s)
        try:
            matcher = llguidance.LLMatcher(self.ll_tokenizer.result(), grammar, log_level=0)
        except BaseException as exc:  # a Rust panic is pyo3's PanicException, a BaseException
            raise compiler_failed(spec.kind, exc) from None
        if matcher.is_error():
            error = matcher.get_error()
            if error.startswith("panic"):
                raise compiler_failed(spec.kind, RuntimeError(error))
            raise GrammarError(f"{spec.kind} does not compile: {one_line(error)}")
        if matches_nothing(matcher, self.eos_token_ids):
            raise GrammarError(f"{spec.kind} matches nothing: no output satisfies it")
        return matcher


@dataclass(eq=False)
class _Job:
    spec: StructuredOutputsParams
    key: tuple[str, str]
    size: int
    order: int  # arrival: ties in size go first come, first served
    target: _Target
    future: Future
    waiters: int = 1  # requests waiting for it; none left before it started: dropped

    @property
    def large(self) -> bool:
        return self.size > SMALL_GRAMMAR_BYTES


class _CompileQueue:
    """The pending compiles and the threads that run them, smallest first (module docstring)."""

    def __init__(self, threads: int):
        self.threads = threads
        self._lock = threading.Condition()
        self._pending: dict[Future, _Job] = {}  # not started yet
        self._large_running = 0
        self._workers: list[threading.Thread] = []
        self._closed = False

    def start(self) -> None:
        """The compile threads, with COMPILE_STACK_BYTES stacks (once)."""
        with self._lock:
            if self._workers:
                return
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                for i in range(self.threads):
                    worker = threading.Thread(target=self._work, name=f"deepinfer-grammar-{i}", daemon=True)
                    worker.start()
                    self._workers.append(worker)
            finally:
                threading.stack_size(previous)

    def put(self, job: _Job) -> None:
        with self._lock:
            self._pending[job.future] = job
            self._lock.notify_all()

    def join(self, future: Future) -> None:
        """One more request waits for future's job (counted while it has not started)."""
        with self._lock:
            job = self._pending.get(future)
            if job is not None:
                job.waiters += 1

    def leave(self, future: Future) -> _Job | None:
        """One request stopped waiting for future's job; the job, dropped, when it was the last one
        and the job had not started."""
        with self._lock:
            job = self._pending.get(future)
            if job is None:
                return None
            job.waiters -= 1
            if job.waiters:
                return None
            del self._pending[future]
        future.cancel()
        return job

    def close(self) -> None:
        """Drop what has not started; the threads end (and their child processes with them)."""
        with self._lock:
            self._closed = True
            pending, self._pending = list(self._pending), {}
            self._lock.notify_all()
        for future in pending:
            future.cancel()

    def _take(self) -> _Job | None:
        """The next job this thread may run (the smallest; a large one only while another thread
        stays free for small ones); None once closed."""
        with self._lock:
            while not self._closed:
                if self._pending:
                    job = min(self._pending.values(), key=lambda j: (j.size, j.order))
                    if not job.large or self._large_running < max(1, self.threads - 1):
                        del self._pending[job.future]
                        self._large_running += job.large
                        return job
                self._lock.wait()
            return None

    def _work(self) -> None:
        sandbox = GrammarSandbox()
        try:
            sandbox.start()  # a child takes ~0.3 s to start: before the first grammar comes, not after
            while (job := self._take()) is not None:
                try:
                    if job.future.set_running_or_notify_cancel():
                        try:
                            job.future.set_result(job.target.compile(job.spec, sandbox))
                        except BaseException as exc:  # the request's error (GrammarError, or llguidance's own failure)
                            job.future.set_exception(exc)
                finally:
                    with self._lock:
                        self._large_running -= job.large
                        self._lock.notify_all()
                job = None  # (its target holds the tokenizer: not past its compile)
        finally:
            sandbox.close()


class GrammarCompiler:
    """Compiles grammars on its own threads (module docstring); submit / release / cached_keys from one thread (the engine's)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 256, timeout_s: float = 30.0, threads: int = COMPILE_THREADS):
        if tokenizer is None:
            raise InvalidRequestError("structured_outputs needs the checkpoint's tokenizer.json, and this checkpoint has none")
        self._tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self.cache_size, self.timeout_s = cache_size, timeout_s
        self._cache: OrderedDict[tuple[str, str], _Job] = OrderedDict()  # least recently used first
        self._target: _Target | None = None
        self._queue = _CompileQueue(threads)
        weakref.finalize(self, self._queue.close)
        self._order = itertools.count()

    def prepare(self) -> Future:
        """Start building llguidance's tokenizer and the compile threads (once); the tokenizer's future."""
        self._queue.start()
        if self._target is None:
            future = Future()
            args = (future, self._tokenizer, self.vocab_size, self.eos_token_ids)
            threading.Thread(target=_build_tokenizer, args=args, name="deepinfer-grammar-tokenizer", daemon=True).start()
            self._target = _Target(future, self.eos_token_ids, self.timeout_s)
        return self._target.ll_tokenizer

    def ll_tokenizer(self):
        """llguidance's tokenizer (waits for `prepare`'s build)."""
        return self.prepare().result()

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """A future of spec's template matcher (raises GrammarError when it does not compile).
        Each caller that stops waiting before it is done calls `release`."""
        key = spec.key()
        self.prepare()  # the tokenizer builds while the grammar is checked
        job = self._cache.get(key)
        if job is not None and not job.future.cancelled():  # (a cached job is cancelled only once the queue closed)
            self._queue.join(job.future)
            self._cache.move_to_end(key)
            return job.future
        job = _Job(spec, key, spec.size(), next(self._order), self._target, Future())
        self._cache[key] = job
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        self._queue.put(job)
        return job.future

    def release(self, future: Future) -> None:
        """One request stopped waiting for future (it was aborted or timed out); a compile nobody
        waits for any more is dropped if it has not started (a later request compiles it again)."""
        job = self._queue.leave(future)
        if job is not None and self._cache.get(job.key) is job:
            del self._cache[job.key]

    def cached_keys(self) -> list[tuple[str, str]]:
        """The cached grammars' keys, least recently used first."""
        return list(self._cache)

    def shutdown(self) -> None:
        """Drop what has not started; the threads end (and their child processes with them)."""
        self._queue.close()


def _build_tokenizer(future: Future, tokenizer, vocab_size: int, eos_token_ids) -> None:
    try:
        future.set_result(build_ll_tokenizer(tokenizer, vocab_size, eos_token_ids))
    except BaseException as exc:  # llguidance could not read the tokenizer: every grammar fails with it
        future.set_exception(exc)
