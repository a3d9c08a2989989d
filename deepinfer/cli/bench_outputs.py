"""Where a benchmark writes (--json FILE, --plot DIR), checked before it runs: a run of minutes must
not end in a path it cannot write."""

from __future__ import annotations

from pathlib import Path

from deepinfer.errors import UserError


def check_outputs(json_path: Path | None, plot_dir: Path | None) -> None:
    """One-line errors for a --json file in a missing folder, a missing --plot folder, or --plot without matplotlib."""
    if json_path is not None and not json_path.parent.is_dir():
        raise UserError(f"cannot write {json_path}: folder {json_path.parent} does not exist")
    if plot_dir is not None:
        if not plot_dir.is_dir():
            raise UserError(f"--plot {plot_dir}: no such folder")
        from deepinfer.bench.plots import require_matplotlib

        require_matplotlib()
