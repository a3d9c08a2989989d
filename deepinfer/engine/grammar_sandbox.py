"""A child process that turns a request's structured_outputs into llguidance's grammar text and
checks it there first, so that a grammar which crashes llguidance fails its request alone.

Why: llguidance's compiler recurses over a grammar's rules; a hostile grammar (a Lark grammar of
3,000 chained rules, a JSON schema whose $defs chain 1,000 $refs) overflows the thread's stack, and
a stack overflow in a Rust extension is a segmentation fault of the whole process: the server, or
`deepinfer run` with no row written. The child runs `grammar_source.translate` (the JSON schema or
Lark conversion and llguidance's validation, the recursion that crashes) on a thread with a
SANDBOX_STACK_BYTES stack; the engine compiles the text the child returns on threads with a stack
STACK_MARGIN times larger (deepinfer.engine.grammar_compiler), so what the child survived the
engine survives. A child that crashes or runs past the timeout is reported as the request's error
and replaced by a fresh one for the next grammar. Its stderr is the engine's.

Protocol: one JSON line per request on the child's stdin ({"fields": StructuredOutputsParams'
fields}), one JSON line per answer on its stdout ({"grammar": text} or {"error": message}). The
child imports llguidance and the small structured_params module only (no torch: it starts in well
under a second), and ends when its stdin closes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

from deepinfer.engine.grammar_source import GrammarError

SANDBOX_STACK_BYTES = 32 << 20  # the child's checking thread: ~10,000 chained Lark rules fit (llguidance 1.9 takes ~3 KB of stack a rule)
STACK_MARGIN = 4  # the engine's compile threads have this many times the child's stack


class GrammarSandbox:
    """One child process (started on first use, restarted after a crash); not thread-safe: each
    compile thread owns one."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None

    def translate(self, spec, timeout_s: float) -> str:
        """spec's grammar text, checked in the child; GrammarError when it does not compile, when
        llguidance crashed on it, or when the check took longer than timeout_s."""
        proc = self.start()
        request = (json.dumps({"fields": dataclasses.asdict(spec)}) + "\n").encode()
        try:
            proc.stdin.write(request)
            proc.stdin.flush()
            answer = self._read_line(proc, time.monotonic() + timeout_s)
        except BrokenPipeError:  # it died before it read the request
            answer = b""
        if not answer:
            raise self._lost(spec.kind, timeout_s, crashed=answer is not None)
        reply = json.loads(answer)
        if "error" in reply:
            raise GrammarError(reply["error"])
        return reply["grammar"]

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()  # the child ends at the end of its input
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def start(self) -> subprocess.Popen:
        """The child, started if it is not running."""
        if self._proc is None:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        return self._proc

    @staticmethod
    def _read_line(proc: subprocess.Popen, deadline: float) -> bytes | None:
        """The child's next answer line; b"" when it ended (crashed), None when the deadline passed."""
        fd, chunks = proc.stdout.fileno(), []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            chunks.append(chunk)
            if chunk.endswith(b"\n"):
                return b"".join(chunks)

    def _lost(self, kind: str, timeout_s: float, crashed: bool) -> GrammarError:
        """The child crashed or hung on this grammar: it is ended, and a fresh one serves the next."""
        proc, self._proc = self._proc, None
        if not crashed:
            proc.kill()
            proc.wait()
            return GrammarError(f"{kind}: llguidance's compiler took more than {timeout_s:g} s on it (grammar_compile_timeout_s); simplify it")
        code = proc.wait()
        if code >= 0:  # it ended by itself: it could not start (its error is on stderr), not this grammar's doing
            return GrammarError(f"{kind} could not be checked: the grammar checker process ended with exit code {code} (its error is on stderr)")
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        return GrammarError(f"{kind}: llguidance's compiler crashed on it (signal {name}): it is too deeply nested or too big; simplify it")


def check_compiles(spec, timeout_s: float = 30.0) -> None:
    """A GrammarError when spec's grammar does not compile (checked in a child, without a
    tokenizer: `deepinfer run`'s flags, before the model loads)."""
    sandbox = GrammarSandbox()
    try:
        sandbox.translate(spec, timeout_s)
    finally:
        sandbox.close()


def _serve() -> None:
    """The child: answer each request line (module docstring) until stdin closes."""
    from deepinfer.engine.grammar_source import translate
    from deepinfer.engine.structured_params import StructuredOutputsParams

    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else printed goes to stderr, not into the answers
    threading.stack_size(SANDBOX_STACK_BYTES)
    for line in sys.stdin.buffer:
        reply = {}

        def check(fields=json.loads(line)["fields"]):
            try:
                reply["grammar"] = translate(StructuredOutputsParams(**fields))
            except Exception as exc:  # GrammarError, or the spec refused (checked by the engine already)
                reply["error"] = str(exc)

        worker = threading.Thread(target=check)
        worker.start()
        worker.join()
        answers.write((json.dumps(reply) + "\n").encode())
        answers.flush()


if __name__ == "__main__":
    _serve()
