"""Waiting in tests: on events (a process's exit, a lock held, a counter reached), never on a guess of
how long something takes, so that a test passes on a machine three times slower than CI's or under
load. The one number is HANG_S, a guard against a hang and nothing else.

HANG_S: the whole suite runs in well under 20 minutes on an idle 2-core machine, so no single thing a
test waits for (a subprocess, a server's start, a request) takes 30 minutes even at three times that
load; reaching it means something hangs, and the error says what was awaited."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

HANG_S = 1800


def wait_until(condition: Callable[[], bool], what: str, proc: subprocess.Popen | None = None, every_s: float = 0.05) -> None:
    """Poll `condition` until it holds. An AssertionError naming `what` if `proc` exits first (with its
    stderr) or after HANG_S (a hang)."""
    deadline = time.monotonic() + HANG_S
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {proc.returncode} first\n{finish(proc, what)[2]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {HANG_S} s, so it hangs (tests/waits.py HANG_S)")
        time.sleep(every_s)


def finish(proc: subprocess.Popen, what: str) -> tuple[int, str, str]:
    """Wait for `proc` to exit: (exit code, stdout, stderr). An AssertionError naming `what` after
    HANG_S (the process is killed: it hangs)."""
    try:
        out, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{what}: still running after {HANG_S} s, so it hangs (tests/waits.py HANG_S); killed\n{err}") from None
    return proc.returncode, out, err


def holds_flock(pid: int, path: Path) -> bool:
    """Whether process `pid` holds a flock() on the file `path`, as Linux's /proc/locks lists it
    ("1: FLOCK  ADVISORY  WRITE <pid> <major>:<minor>:<inode> 0 EOF"; a waiter's line has "->").
    Matched by pid and inode (an overlay file system may list another device than stat gives)."""
    try:
        inode = path.stat().st_ino
    except FileNotFoundError:
        return False
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[4] == str(pid) and fields[5].rsplit(":", 1)[-1] == str(inode):
            return True
    return False


@contextlib.contextmanager
def stopped_once(proc: subprocess.Popen, condition: Callable[[], bool], what: str):
    """Stop `proc` (SIGSTOP) at a moment when `condition` holds, keep it stopped inside the block, and
    let it go on (SIGCONT) after. `condition` is checked while `proc` is stopped, so it still holds
    inside the block whatever the machine's speed (a file lock held, rows written)."""

    def stopped_and_true() -> bool:
        os.kill(proc.pid, signal.SIGSTOP)
        _, status = os.waitpid(proc.pid, os.WUNTRACED)  # returns once it is stopped (or gone)
        if not os.WIFSTOPPED(status):
            proc.returncode = os.waitstatus_to_exitcode(status)  # it ended first: let Popen know
            return False
        if condition():
            return True
        os.kill(proc.pid, signal.SIGCONT)
        return False

    wait_until(stopped_and_true, what, proc)
    try:
        yield
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
