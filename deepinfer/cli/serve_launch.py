"""Starting the N ranks of `deepinfer serve --ep N` on this host, and stopping them gracefully.

Not torchrun's launcher (deepinfer.cli.launch), because a server stops differently from a batch:
torchrun answers SIGTERM by sending it to every rank at once and exits 143, while a server must
drain through rank 0 (the others are stepped by it) and exit 0. So this process:

- checks once what every rank would check (flags, backend devices, the experts dividing over the
  ranks), binds the listening socket (a taken port: one line, no rank started) and hands it to rank
  0; a free port on 127.0.0.1 is the ranks' rendezvous (MASTER_PORT);
- starts `python -m deepinfer serve ...` N times with torchrun's environment for each (RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS=1 unless set), each in a
  process group of its own, so that a terminal's Ctrl-C reaches this process only. Rank 0 keeps
  the terminal; ranks 1..N-1 write to log files in a folder of this run;
- on SIGINT / SIGTERM / SIGHUP sends SIGTERM to rank 0, which stops taking requests, gives the
  unfinished ones --shutdown-timeout seconds and then tells the other ranks to stop; every rank
  exits 0 and so does this process. A second signal kills the ranks (SIGKILL);
- when a rank exits first (it failed), sends SIGTERM to rank 0 and gives the others
  `FAILED_GRACE_S` seconds to end on their own (their collectives break) before killing them; then
  prints ONE line, as deepinfer.cli.launch does (the first rank that failed on its own, from the
  ranks' records in the folder), and exits with that rank's code.

A run that ends well removes the folder. If this process is killed (SIGKILL), the ranks are not:
stop them by their process group.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from deepinfer.cli import launch

FAILED_GRACE_S = 10.0
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


@dataclass(frozen=True)
class _Exit:
    exitcode: int  # what launch.failure_line reads of a failed rank (negative: killed by that signal)


def launch_serve_ranks(args, parser) -> int:
    from deepinfer.cli.run import check_ep_setup
    from deepinfer.cli.serve import listen
    from deepinfer.distributed.group import free_port, rank_env
    from deepinfer.options import parse_assignments

    parse_assignments(args.backend_option)
    check_ep_setup(args)
    sock = listen(args.host, args.port)
    nproc = args.ep
    folder = Path(tempfile.mkdtemp(prefix="deepinfer-serve-"))
    words = ["serve", *launch.command_line(parser, args)]
    verbose = ["-v"] if getattr(args, "verbose", False) else []
    master_port = free_port()
    print(f"deepinfer: starting {nproc} ranks of deepinfer serve (rank 0 serves; the others' logs: {folder})", file=sys.stderr, flush=True)
    procs: list[subprocess.Popen] = []
    logs = []
    stops: list[int] = []  # the signals received
    saved = {name: signal.getsignal(getattr(signal, name)) for name in STOP_SIGNALS}

    def on_signal(signum, frame):
        stops.append(signum)
        if len(stops) == 1:
            _send(procs[:1], signal.SIGTERM)
        else:
            _send(procs, signal.SIGKILL)

    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), on_signal)
    try:
        for rank in range(nproc):
            env = {**os.environ, **rank_env(rank, nproc, master_port), launch.LAUNCH_DIR_ENV: str(folder)}
            env.setdefault("OMP_NUM_THREADS", "1")
            extra, fds, out = [], (), None
            if rank == 0:
                extra, fds = ["--listen-fd", str(sock.fileno())], (sock.fileno(),)
            else:
                out = open(folder / f"rank{rank}.log", "w")
                logs.append(out)
            argv = [sys.executable, "-m", "deepinfer", *verbose, *words, *extra]
            procs.append(subprocess.Popen(argv, env=env, pass_fds=fds, stdout=out, stderr=out, start_new_session=True))
            if stops:  # a signal came while starting: stop what runs
                _send(procs, signal.SIGKILL)
                break
        sock.close()  # rank 0 holds it now
        codes = _wait(procs, stops)
    finally:
        for name, handler in saved.items():
            signal.signal(getattr(signal, name), handler)
        for out in logs:
            out.close()
    if all(code == 0 for code in codes):
        shutil.rmtree(folder, ignore_errors=True)
        return 0
    if stops:  # stopped before rank 0 could stop gracefully (while loading), or killed by a second signal
        code = 128 + stops[0]
        print(f"deepinfer: stopped by {signal.Signals(stops[0]).name} (logs: {folder})", file=sys.stderr)
        return code
    failures = {rank: _Exit(code) for rank, code in enumerate(codes) if code != 0}
    code, line = launch.failure_line(folder, failures, nproc, "serve")
    print(f"deepinfer: error: {line} (logs: {folder})", file=sys.stderr)
    return code


def _wait(procs: list[subprocess.Popen], stops: list[int]) -> list[int]:
    """Every rank's exit code, once all have exited (the module docstring says what happens on the way)."""
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(code is not None for code in codes):
            return codes
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = time.monotonic()
            _send(procs[:1], signal.SIGTERM)
        if failed_at is not None and time.monotonic() - failed_at > FAILED_GRACE_S:
            _send(procs, signal.SIGKILL)
        time.sleep(0.1)


def _send(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass
