"""The files of a model folder, read only when each is a regular file inside the folder.

A checkpoint folder is input from anyone (a download, an unpacked archive): its shard index names
files by relative path, and it may hold symlinks, FIFOs or devices. Every file the loader reads is
resolved first (realpath: `..` and symlinks followed) and refused, before it is opened, unless it
lies inside the folder's own realpath and is a regular file. An index entry `../../other/x` or a
symlink to `/etc/passwd` would read a file the checkpoint does not own; a FIFO would block the load
for ever, a device would be read without end.

The one exception: a Hugging Face hub cache snapshot (`models--org--name/snapshots/<rev>/`) holds
symlinks into its model's `blobs/` folder, which counts as inside.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from deepinfer.model.errors import CheckpointError

MAX_JSON_BYTES = 64 * 1024 * 1024  # config, tokenizer config, shard index: kilobytes to a few megabytes

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def allowed_roots(folder: Path) -> tuple[str, ...]:
    """Real paths a file of `folder` may resolve into: the folder, and a hub snapshot's blobs/."""
    real = os.path.realpath(folder)
    roots = [real]
    snapshots = os.path.dirname(real)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith("models--"):
        roots.append(os.path.join(repo, "blobs"))
    return tuple(roots)


def _inside(real: str, roots: tuple[str, ...]) -> bool:
    return any(os.path.commonpath([real, root]) == root for root in roots)


def _not_regular(mode: int) -> str | None:
    """What a non-regular file is ("a FIFO (named pipe)", ...); None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def folder_file(folder: Path, name: str, named_by: str | None = None) -> Path | None:
    """`folder / name` when it is a regular file inside the folder; None when nothing is there.

    Refused with a CheckpointError, before anything is opened: a path that resolves outside the
    folder (`..`, an absolute name, a symlink out; a dangling one too) and anything that is not a
    regular file. `named_by` says who named the file (an index entry), for the message.
    """
    if not name or "\0" in name:
        raise CheckpointError(f"{named_by or folder} names {name!r}, which is not a file name", "fix the name")
    path = folder / name
    real = os.path.realpath(path)
    if not _inside(real, allowed_roots(folder)):
        if named_by:
            raise CheckpointError(
                f"{named_by} names {name!r}, which resolves to {real}, outside the model folder {folder}",
                "shard paths must stay inside the folder: fix the index, or copy the shard into the folder",
            )
        raise CheckpointError(f"{path} resolves to {real}, outside the model folder {folder}", "copy the file into the folder instead of linking to it")
    if not os.path.lexists(real):
        return None
    regular_file(path, f"{named_by} names {name!r}, and " if named_by else "")
    return path


def regular_file(path: Path, prefix: str = "") -> None:
    """CheckpointError unless `path` is (now) a regular file; `prefix` starts the message."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise CheckpointError(f"{prefix}{path}: cannot read it ({exc.strerror or exc})", "check that the file exists and is readable") from None
    kind = _not_regular(mode)
    if kind is not None:
        raise CheckpointError(f"{prefix}{path} is {kind}, not a regular file", "replace it with the real file")


def open_regular(path: Path) -> BinaryIO:
    """Open a file for reading, refusing (before any read) anything but a regular file.

    O_NONBLOCK keeps the open itself from blocking on a FIFO swapped in after `folder_file`
    looked; fstat on the open descriptor then decides.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open it ({exc.strerror or exc})", "check that the file exists and is readable") from None
    kind = _not_regular(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise CheckpointError(f"{path} is {kind}, not a regular file", "replace it with the real file")
    return os.fdopen(fd, "rb")


def read_text(path: Path, limit: int | None = None) -> str:
    """A regular file's text (UTF-8); CheckpointError when it is larger than `limit` bytes or not UTF-8."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise CheckpointError(f"{path}: {size} bytes, more than the {limit} a file of this kind can sensibly hold", "fix or re-download it")
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text ({exc})", "fix or re-download it") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file whose top level must be an object; one-line CheckpointError for anything else."""
    text = read_text(path, MAX_JSON_BYTES)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise CheckpointError(f"{path}: not valid JSON ({reason})", "fix or re-download it") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: the top level is {json_type(value)}, expected a JSON object", "fix or re-download it")
    return value


def json_type(value: Any) -> str:
    """How JSON calls a parsed value's type: "a list", "a string", ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object" if isinstance(value, dict) else type(value).__name__
