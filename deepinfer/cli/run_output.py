"""The output file of `deepinfer run -o` and `deepinfer run-batch -o`: one JSON row per request, in
input order, kept safe from kills, reruns and mistakes. Each command describes its rows to --resume
with a RowFormat (run-batch's: deepinfer/cli/batch_rows.py); `run`'s are below.

A `run` row is a result, `{"id" | "custom_id": ..., "prompt", "text", "token_ids", "finish_reason",
"prompt_tokens", "completion_tokens"}` (with "logprobs" and "cumulative_logprob", "prompt_logprobs"
when the request asks for them: `logprobs_json`), or an error, `{"id" | "custom_id": ..., "error":
{"message": str, "type": "invalid_request_error" | "generation_error"}}` (the request was refused
before it ran / failed while running or being written). Error rows are written in JSON's ASCII
form, so that even an id that is not valid Unicode text is written back as the input spelled it.

What keeps the file safe:
- the output may not be the input (the same file: device and inode, so hard and symbolic links
  count too), checked before anything is written;
- an existing non-empty output needs --resume (continue it) or --overwrite (replace it; emptied only
  once the run is about to generate, so a run that fails before keeps the old file);
- the run holds an exclusive lock (flock) on a regular output file for its whole length: a second
  run on the same file fails at once instead of writing duplicates;
- each row goes out in one write() and nothing is ever rewritten, so a killed run leaves whole rows
  and at most a torn last line. --resume drops a torn last line only if it is the beginning of a
  row, and refuses any line that is not a row (naming it);
- a write that fails (disk full) ends the run with one line; the rows before it stay.
"""

from __future__ import annotations

import codecs
import errno
import fcntl
import json
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from deepinfer.errors import UserError

INVALID_REQUEST = "invalid_request_error"  # refused before it ran
GENERATION_FAILED = "generation_error"  # failed while running or being written
ROW_STARTS = ('{"id": ', '{"custom_id": ')  # how every row begins (json.dumps, id key first)
ROW_SECOND_KEYS = (', "prompt": ', ', "error": ')  # and goes on
MIN_JSON_LOGPROB = -9999.0  # what a -inf log-probability is written as (vLLM's)


def result_row(request, prompt: str | None, output) -> dict:
    """The request's result row; an error row (generation_error) when it failed while running (its grammar)."""
    completion = output.outputs[0]
    if completion.error is not None:
        return error_row(request, f"{request.source}: {completion.error}", GENERATION_FAILED)
    row = {
        request.id_key: request.id,
        "prompt": prompt,
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": len(completion.token_ids),
    }
    if completion.logprobs is not None:
        row["logprobs"] = logprobs_json(completion.logprobs)
        row["cumulative_logprob"] = json_logprob(completion.cumulative_logprob)
    if output.prompt_logprobs is not None:
        row["prompt_logprobs"] = logprobs_json(output.prompt_logprobs)
    return row


def json_logprob(logprob: float) -> float:
    """A log-probability as JSON writes it: -inf (a token the request's options banned, reported
    with --logprobs-mode processed_logprobs) becomes -9999.0, as vLLM's server writes it; JSON has
    no infinities."""
    return max(logprob, MIN_JSON_LOGPROB)


def logprobs_json(positions) -> list:
    """Per position, vLLM's {token id: Logprob} as JSON (None stays null): {"<token id>": {"logprob",
    "rank", "decoded_token"}}, in the dict's order (the chosen token, then the top tokens by rank),
    as vLLM's API writes prompt_logprobs. Keyed by id, not text: two tokens may share a text."""
    def entry(lp) -> dict:
        return {"logprob": json_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}

    return [None if position is None else {str(token): entry(lp) for token, lp in position.items()} for position in positions]


def error_row(request, message: str, kind: str = INVALID_REQUEST) -> dict:
    return {request.id_key: request.id, "error": {"message": message, "type": kind}}


def row_text(row: dict) -> str:
    """The row as one line of JSON (no newline). Results keep their text readable (non-ASCII
    as is); error rows are ASCII. Raises UnicodeEncodeError for a result that is not valid Unicode."""
    if "error" in row:
        return json.dumps(row, ensure_ascii=True)
    text = json.dumps(row, ensure_ascii=False)
    text.encode("utf-8")
    return text


def is_row(item) -> bool:
    """A deepinfer result or error row (parsed)."""
    return isinstance(item, dict) and ("id" in item or "custom_id" in item) and ("text" in item or "error" in item)


@dataclass(frozen=True)
class RowFormat:
    """What the rows of one command's output look like, for --resume: which parsed lines are rows,
    the id of a row (what --resume skips by), and how a row begins (json.dumps, its id key first,
    then one of `second_keys`), to tell a torn last row from a line that is no row at all."""

    what: str  # "a deepinfer result or error row", for messages
    is_row: Callable[[Any], bool]
    row_id: Callable[[dict], Any]
    starts: tuple[str, ...]
    second_keys: tuple[str, ...]


RUN_ROWS = RowFormat(
    "a deepinfer result or error row", is_row, lambda item: item["custom_id" if "custom_id" in item else "id"], ROW_STARTS, ROW_SECOND_KEYS
)


def is_row_start(torn: bytes, rows: RowFormat = RUN_ROWS) -> bool:
    """Whether a torn last line (no newline, not complete JSON) is the beginning of a row: what a
    run killed while writing it leaves, and the only torn line --resume may drop."""
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(torn, final=False)  # a cut multibyte character is fine
    except UnicodeDecodeError:
        return False
    for start in rows.starts:
        if start.startswith(text):
            return True
        if not text.startswith(start):
            continue
        rest = text[len(start) :]
        try:
            _, end = json.JSONDecoder().raw_decode(rest)  # the id
        except ValueError:
            return rest.startswith('"')  # cut inside a string id
        after = rest[end:]
        return any(key.startswith(after) or after.startswith(key) for key in rows.second_keys)
    return False


def add_output_flags(p, rows: str, description: str) -> None:
    """The "output" flag group: -o, --resume and --overwrite, the flags of the output file this module
    keeps safe (`rows`: what the file holds, for -o's help), and --no-progress. `description`: the
    group's --help text (its first line the summary)."""
    group = p.add_argument_group("output", description)
    group.add_argument("-o", "--output", metavar="FILE", help=f"write {rows}, in input order")
    group.add_argument("--resume", action="store_true", help="skip the requests already in --output (error rows included) and append the rest")
    group.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file (symlinks followed, hard links included)."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def check_output_args(args) -> Path | None:
    """The output path, after the checks that need no lock: flags that fit together, a folder that
    exists, not the input, not an existing file without --resume / --overwrite."""
    if args.resume and args.overwrite:
        raise UserError("--resume and --overwrite contradict each other; pick one")
    if args.resume and not args.output:
        raise UserError("--resume needs -o/--output: the file whose finished ids to skip")
    if args.overwrite and not args.output:
        raise UserError("--overwrite needs -o/--output")
    if not args.output:
        return None
    path = Path(args.output)
    if path.is_dir():
        raise UserError(f"output {path} is a directory")
    if not path.parent.exists():
        raise UserError(f"output folder {path.parent} does not exist")
    if args.input and same_file(args.input, path):
        raise UserError(f"output {path} is the input file {args.input} (the same file); write the results to another file")
    exists = path.exists()
    if exists and path.stat().st_size > 0 and not (args.resume or args.overwrite):
        raise UserError(f"output file {path} already exists; pass --resume to continue it or --overwrite to replace it")
    if args.resume and exists and not path.is_file():
        raise UserError(f"--resume needs a regular output file; {path} is not one")
    return path


@dataclass
class Scan:
    """What an existing output holds: the ids of its rows (as JSON text) and how to repair its end."""

    done: set[str] = field(default_factory=set)
    torn_at: int | None = None  # offset of a torn last line to drop
    needs_newline: bool = False  # the last row is whole, only its newline is missing


def scan(path: Path, rows: RowFormat = RUN_ROWS) -> Scan:
    """Read an output file for --resume (nothing is changed). A UserError for a line that is not a
    row, or a last line that is neither a row nor the beginning of one."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    result = Scan()
    lines = data.split(b"\n")
    last = lines.pop()  # b"" when the file ends with a newline
    number = len(lines) + 1
    if last.strip():
        try:
            whole = json.loads(last)
        except ValueError:
            whole = None
        if rows.is_row(whole):
            result.needs_newline = True
            lines.append(last)
        elif whole is None and is_row_start(last, rows):
            result.torn_at = len(data) - len(last)
        else:
            raise UserError(f"{path} line {number}: the last line is not {rows.what}, nor the start of one; is -o the right file?")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise UserError(f"{path} line {number} is not valid JSON; fix or remove it, then --resume again") from None
        if not rows.is_row(item):
            raise UserError(f"{path} line {number} is not {rows.what}; is -o the right file?")
        result.done.add(json.dumps(rows.row_id(item)))
    return result


def check_unlocked(path: Path) -> None:
    """A UserError when another run holds the output's lock (the launcher's check; the run locks)."""
    if not path.is_file():
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return  # the run itself will say why it cannot open it
    try:
        _lock(fd, path)
    finally:
        os.close(fd)  # releases the probe's lock


def _lock(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(
            f"output {path} is in use by another deepinfer run (it holds the file's lock); wait for it to finish or write to another file"
        ) from None
    except OSError:
        pass  # a file system without flock: no protection, as before


class OutputFile:
    """The open, locked output. `resume()` repairs a torn end and returns the finished ids;
    `begin()` empties it for --overwrite; `write()` appends one row."""

    def __init__(self, path: Path, fd: int, created: bool):
        self.path, self.fd, self.created = path, fd, created
        self.regular = stat.S_ISREG(os.fstat(fd).st_mode)
        self.rows = 0

    @classmethod
    def open(cls, path: Path) -> OutputFile:
        created = not path.exists()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
        out = cls(path, fd, created)
        if out.regular:
            try:
                _lock(fd, path)
            except UserError:
                os.close(fd)
                raise
        return out

    def resume(self, rows: RowFormat = RUN_ROWS) -> set[str]:
        found = scan(self.path, rows)  # under the lock: nobody else appends meanwhile
        try:
            if found.torn_at is not None:
                print(f"deepinfer: {self.path}: dropping an unfinished last line from an interrupted run", file=sys.stderr)
                os.ftruncate(self.fd, found.torn_at)
            elif found.needs_newline:
                self._write(b"\n")
        except OSError as exc:
            raise UserError(f"cannot repair the end of {self.path}: {exc.strerror or exc}") from None
        return found.done

    def begin(self, overwrite: bool) -> None:
        """Called once the run is about to generate: --overwrite empties the file now."""
        if overwrite and self.regular:
            os.ftruncate(self.fd, 0)

    def write(self, line: str) -> None:
        self._write((line + "\n").encode("utf-8"))
        self.rows += 1

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                written = os.write(self.fd, view)
            except OSError as exc:
                full = " (the disk is full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
                kept = f"; the {self.rows} rows written before are kept, and --resume continues" if self.rows else ""
                raise UserError(f"cannot write {self.path}: {exc.strerror or exc}{full}{kept}") from None
            view = view[written:]

    def close(self) -> None:
        """Release the lock; a file this run created and never wrote to is removed."""
        try:
            if self.created and self.rows == 0 and self.regular and os.fstat(self.fd).st_size == 0:
                self.path.unlink(missing_ok=True)
        except OSError:
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass


class InOrder:
    """Hands out rows in input order: row i once every row before it is out (rows that finish
    early wait; an interrupted run loses only those, and --resume recomputes them)."""

    def __init__(self, emit):
        self.emit = emit
        self.next = 0
        self.held: dict[int, object] = {}

    def put(self, index: int, item) -> None:
        self.held[index] = item
        while self.next in self.held:
            self.emit(self.next, self.held.pop(self.next))
            self.next += 1
