"""The embedded models' names (`--model tiny-v3` / `tiny-v4` / `tiny-v41`, no model: tiny-v3) and what a model
argument names, without importing torch: the command line checks --model before anything loads.
The models themselves are deepinfer.model.embedded."""

from __future__ import annotations

from pathlib import Path

from deepinfer.model.errors import LoadError

DEFAULT = "tiny-v3"
NAMES = ("tiny-v3", "tiny-v4", "tiny-v41")


def resolve_model(path: str | None) -> tuple[str | None, str | None]:
    """(checkpoint path, embedded alias): None is the default embedded model; the NAMES name the
    embedded ones unless a folder of that name exists (then the folder wins)."""
    if path is None:
        return None, DEFAULT
    if path in NAMES and not Path(path).expanduser().exists():
        return None, path
    return path, None


def check_model_path(path: str | None) -> Path | None:
    """The checkpoint folder `path` names (None for an embedded model); LoadError when there is none,
    listing the embedded models (a misspelt `tiny-v2` is most likely one of them)."""
    path, embedded = resolve_model(path)
    if embedded is not None:
        return None
    folder = Path(path).expanduser()
    if not folder.exists():
        raise LoadError(f"model path {path} does not exist", f"pass an HF checkpoint folder, or an embedded model: {', '.join(NAMES)}")
    if not folder.is_dir():
        raise LoadError(f"model path {path} is a file", "pass the checkpoint folder that holds it")
    return folder
