"""Starting N ranks of a deepinfer command on this host with torchrun (one process per device).

`deepinfer run --ep N` and `deepinfer bench ops --ep N` start
`python -m torch.distributed.run --standalone --nproc-per-node N -m deepinfer <command> ...`, each
rank running the same command under torchrun's environment, and return torchrun's exit code.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys


def launched_by_torchrun() -> bool:
    """True in a rank process started by torchrun (its environment names the rank)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun(nproc: int, argv: list[str], *, what: str, verbose: bool = False) -> int:
    """Run `deepinfer [-v] <argv>` as `nproc` ranks on this host; torchrun's exit code.

    `what` names the command in messages ("run", "bench ops"). OMP_NUM_THREADS defaults to 1
    (torchrun's own default for several ranks, without its banner). A SIGTERM to this process is
    passed on to torchrun, which stops its ranks."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "-m", "deepinfer", *(["-v"] if verbose else []), *argv,
    ]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"deepinfer: starting {nproc} ranks: torchrun --standalone --nproc-per-node {nproc} -m deepinfer {what} ...", file=sys.stderr)
    proc = subprocess.Popen(command, env=env)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM))
    try:
        code = wait(proc)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if code != 0:
        print(f"deepinfer: error: the {nproc}-rank {what} failed (torchrun exit code {code}); the ranks' errors are above", file=sys.stderr)
    return code


def wait(proc: subprocess.Popen) -> int:
    """torchrun's exit code. Ctrl-C reaches torchrun and its ranks too (one process group): give
    them time to stop, then kill torchrun."""
    try:
        return proc.wait()
    except KeyboardInterrupt:
        try:
            proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.kill()
            proc.wait()
        return 130


def command_line(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """`parser`'s options in `args` as command-line words (those that differ from the defaults),
    so each rank torchrun starts re-parses the same command."""
    words: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value:
                words += [flag, str(item)]
        else:
            words += [flag, str(value)]
    return words
