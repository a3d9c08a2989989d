"""Requests waiting for their grammar: held out of the scheduler until it has compiled.

A request with structured_outputs is added here instead of to the scheduler's queue; its grammar
compiles in the GrammarCompiler's threads meanwhile (deepinfer.engine.grammar_compiler: nothing of
llguidance's runs on the engine thread but the matchers' copies and masks), and the other requests
keep running. At each
engine step, `admit` queues the requests whose grammar is ready (each sample gets its own matcher)
and fails those whose grammar did not compile, or is not ready `timeout_s` after the request was
added: such a request finishes at once with finish_reason "error" and the message in its output's
`error`; nothing else is affected. A request that stops waiting (aborted, timed out) tells the
compiler (`release`), which drops a compile nobody waits for before it starts. When nothing else
is left to run, `admit` waits for the first grammar to be ready (or to run out of time) rather than
spin.
"""

from __future__ import annotations

import concurrent.futures
import time
from concurrent.futures import Future
from typing import Callable

from deepinfer.engine.sequence import Sequence, SequenceStatus
from deepinfer.engine.structured_output import GrammarError, SequenceGrammar, one_line


def _nothing(future: Future) -> None:
    pass


class GrammarWait:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        # (sample 0, its grammar, when it was added, how to tell the grammar's compiler that it stopped waiting)
        self._waiting: list[tuple[Sequence, Future, float, Callable[[Future], None]]] = []

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __len__(self) -> int:
        return len(self._waiting)

    def num_samples(self) -> int:
        """The samples of the waiting requests (n each)."""
        return sum(len(head.samples) for head, *_ in self._waiting)

    def add(self, head: Sequence, grammar: Future, release: Callable[[Future], None] = _nothing) -> None:
        """Hold head's request until `grammar` is ready; release(grammar) if it stops waiting before."""
        self._waiting.append((head, grammar, time.monotonic(), release))

    def remove(self, head: Sequence) -> None:
        """Stop waiting for head's request (it was aborted)."""
        for entry in [entry for entry in self._waiting if entry[0] is head]:
            self._waiting.remove(entry)
            entry[3](entry[1])

    def clear(self) -> None:
        for _, grammar, _, release in self._waiting:
            release(grammar)
        self._waiting.clear()

    def admit(self, queue, block: bool) -> list[Sequence]:
        """Queue (queue(seq)) each request whose grammar is ready; fail the others that are due.
        Returns the failed requests' heads. block: wait until at least one request is settled."""
        if block and self._waiting:
            deadline = min(entry[2] for entry in self._waiting) + self.timeout_s
            pending = [entry[1] for entry in self._waiting]
            concurrent.futures.wait(pending, timeout=max(0.0, deadline - time.monotonic()), return_when=concurrent.futures.FIRST_COMPLETED)
        failed, still = [], []
        now = time.monotonic()
        for head, future, added, release in self._waiting:
            if future.done():
                try:
                    template = future.result()
                except GrammarError as exc:
                    failed.append(_fail(head, str(exc)))
                    continue
                except Exception as exc:  # llguidance's own failure (its tokenizer, say): this request's, not the run's
                    failed.append(_fail(head, f"grammar compilation failed: {type(exc).__name__}: {one_line(str(exc))}"))
                    continue
                for sample in head.samples:
                    sample.grammar = SequenceGrammar(template)
                queue(head)
            elif now - added >= self.timeout_s:
                release(future)
                failed.append(_fail(head, f"the grammar did not compile within grammar_compile_timeout_s={self.timeout_s:g} s"))
            else:
                still.append((head, future, added, release))
        self._waiting = still
        return failed


def _fail(head: Sequence, message: str) -> Sequence:
    """Finish every sample of head's request with the error (they never ran)."""
    for sample in head.samples:
        sample.status = SequenceStatus.FINISHED
        sample.finish_reason, sample.error = "error", message
    head.held_back = []
    return head
