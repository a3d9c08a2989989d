"""Starting N ranks of a deepinfer command on this host with torchrun (one process per device), and
reporting a failed run in one line.

`deepinfer run --ep N` and `deepinfer bench ... --ep N` call `torchrun(N, argv, what=...)`, which
runs torchrun's launcher (torch.distributed.run) in this process for `python -m deepinfer <argv>`
on N local ranks and returns an exit code:

- rank 0 keeps this terminal: its progress, results and summary are the run's output. Ranks 1..N-1
  write theirs to log files in a folder of this run (torchrun's --log-dir / --redirects);
- a rank that fails records its one-line error in that folder instead of printing it
  (`run_as_rank`, which finds the folder in DEEPINFER_LAUNCH_DIR); torchrun's own failure report
  (ChildFailedError) and its log messages go to torchrun.log there;
- a run that completes with some requests failed (`report_outcome`) exits 0 from every rank, and
  this process exits with the rank's code;
- when the run fails, this process prints ONE line: the first error recorded by a rank that failed
  on its own (the others stopped because of it), or, for a rank that died without a word (killed,
  out of memory), its exit code or signal; and the folder. A run that succeeds removes the folder.

OMP_NUM_THREADS defaults to 1 for the ranks (torchrun's own default for several ranks, without its
banner). Ctrl-C and SIGTERM reach torchrun's handlers, which stop the ranks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from deepinfer.errors import UserError

LAUNCH_DIR_ENV = "DEEPINFER_LAUNCH_DIR"  # set by `torchrun` for its ranks: where they record errors
TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's launcher takes these over


def launched_by_torchrun() -> bool:
    """True in a rank process started by torchrun (its environment names the rank)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun(nproc: int, argv: list[str], *, what: str, verbose: bool = False) -> int:
    """Run `deepinfer [-v] <argv>` as `nproc` ranks on this host; 0, or the failed run's exit code
    after one line naming the failure. `what` names the command in messages ("run", "bench ops")."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    folder = Path(tempfile.mkdtemp(prefix=f"deepinfer-{what.replace(' ', '-')}-"))
    command = [
        "--standalone", "--nproc-per-node", str(nproc), "--log-dir", str(folder / "ranks"),
        "--redirects", ",".join(f"{r}:3" for r in range(1, nproc)),
        "-m", "deepinfer", *(["-v"] if verbose else []), *argv,
    ]  # fmt: skip
    print(f"deepinfer: starting {nproc} ranks: torchrun --standalone --nproc-per-node {nproc} -m deepinfer {what} ...", file=sys.stderr)
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), LAUNCH_DIR_ENV: str(folder)}
    saved_env = {name: os.environ.get(name) for name in env}
    saved_signals = {name: signal.getsignal(getattr(signal, name)) for name in TORCHRUN_SIGNALS if hasattr(signal, name)}
    torch_log = logging.getLogger("torch.distributed")
    log_file = logging.FileHandler(folder / "torchrun.log")
    saved_log = (torch_log.propagate, torch_log.handlers[:])
    torch_log.handlers, torch_log.propagate = [log_file], False
    os.environ.update(env)
    code, line = 0, ""
    try:
        run(parse_args(command))
    except ChildFailedError as exc:
        log_file.stream.write(exc.format_msg() + "\n")
        code, line = failure_line(folder, exc.failures, nproc, what)
    except SignalException as exc:
        interrupted = exc.sigval == signal.SIGINT
        code = 130 if interrupted else 128 + int(exc.sigval)
        line = "interrupted" if interrupted else f"stopped by {signal.Signals(exc.sigval).name}; the ranks were stopped"
    except Exception as exc:  # torchrun itself failed (its rendezvous, a port): still one line
        first = (str(exc).strip().splitlines() or [""])[0]
        code, line = 1, f"torchrun could not run the {nproc} ranks: {type(exc).__name__}: {first}"
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for name, handler in saved_signals.items():
            signal.signal(getattr(signal, name), handler)
        torch_log.propagate, torch_log.handlers = saved_log
        log_file.close()
    if code == 0:
        code = _outcome(folder)
        shutil.rmtree(folder, ignore_errors=True)
        return code
    prefix = "deepinfer: " if code == 130 else "deepinfer: error: "
    print(f"{prefix}{line} (logs: {folder})", file=sys.stderr)
    return code


def failure_line(folder: Path, failures: dict, nproc: int, what: str) -> tuple[int, str]:
    """(exit code, one line) for a failed run, from the ranks' records and torchrun's failures."""
    records = sorted(read_records(folder), key=lambda r: r["time"])
    own = [r for r in records if not r["peer"]]
    peers = [r for r in records if r["peer"]]
    recorded = {r["rank"] for r in records}
    deaths = "; ".join(f"rank {rank} {_death(f)}" for rank, f in sorted(failures.items()) if rank not in recorded)
    if own:
        return own[0]["exit_code"], own[0]["message"] + (f"; also {deaths}" if deaths else "")
    if deaths:
        return 1, f"the {nproc}-rank {what} failed: {deaths}" + (f"; then {peers[0]['message']}" if peers else "")
    if peers:
        return peers[0]["exit_code"], peers[0]["message"]
    return 1, f"the {nproc}-rank {what} failed (torchrun reported no rank)"


def _death(failure) -> str:
    code = failure.exitcode
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    return f"exited with code {code}"


# ---- the rank side --------------------------------------------------------------------------------


def run_as_rank(body, rank: int) -> int:
    """Run a rank's command. Under `torchrun` above, an error is recorded in the launch folder
    (the launcher prints the run's one line) instead of printed; else it propagates as usual. A rank
    other than 0 then ends without the interpreter's teardown (`_leave`)."""
    return _leave(_run_rank_body(body, rank), rank)


def _leave(code: int, rank: int) -> int:
    """Rank 0 returns; the others flush and end at once. Rank 0 hosts the rendezvous store: once it
    has gone, the teardown of torch.distributed's objects at a later rank's exit aborted that rank
    at times ("terminate called without an active exception", SIGABRT) after its work was done, so
    a finished run was reported failed (seen for serve --ep under load, and bench e2e-ep idle). A
    rank's outputs are closed by its command; only stdout and stderr are left to flush."""
    if rank == 0:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_rank_body(body, rank: int) -> int:
    folder = os.environ.get(LAUNCH_DIR_ENV)
    if not folder:
        return body()
    try:
        return body()
    except UserError as exc:
        record_error(Path(folder), rank, str(exc), exc.exit_code, peer=_is_peer(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        record_error(Path(folder), rank, f"rank {rank}: interrupted", 130, peer=True)
        return 130
    except Exception as exc:
        where = Path(folder) / f"rank{rank}.traceback"
        where.write_text(traceback.format_exc())
        first = (str(exc).strip().splitlines() or [""])[0]
        record_error(Path(folder), rank, f"rank {rank}: {type(exc).__name__}: {first} (traceback in {where})", 1, peer=False)
        return 1


def report_outcome(code: int) -> int:
    """What a rank returns for a run that completed with exit code `code` (1: some requests failed):
    0, so that torchrun sees no failed rank; the launcher above, if any, exits with `code`."""
    folder = os.environ.get(LAUNCH_DIR_ENV)
    if code and folder:
        (Path(folder) / "outcome").write_text(str(code))
    return 0


def _outcome(folder: Path) -> int:
    try:
        return int((folder / "outcome").read_text())
    except (OSError, ValueError):
        return 0


def _is_peer(exc: UserError) -> bool:
    """An error that is a consequence: another rank failed, died or stopped answering."""
    from deepinfer.distributed.group import PeerFailure

    return isinstance(exc, PeerFailure)


def record_error(folder: Path, rank: int, message: str, exit_code: int, peer: bool) -> None:
    """Keep this rank's first error for the launcher (written whole: a temporary file, renamed)."""
    target = folder / f"rank{rank}.error.json"
    if target.exists():
        return
    temporary = folder / f".rank{rank}.error.json.tmp"
    temporary.write_text(json.dumps({"rank": rank, "time": time.time(), "message": message, "exit_code": exit_code, "peer": peer}))
    os.replace(temporary, target)


def read_records(folder: Path) -> list[dict]:
    records = []
    for path in sorted(folder.glob("rank*.error.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records


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
        elif isinstance(value, list):  # nargs="+"
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return words
