"""Errors of checkpoint loading: one line naming the tensor or file, and the fix."""

from __future__ import annotations

from deepinfer.errors import UserError


class LoadError(UserError):
    """A checkpoint or config that cannot be loaded (missing/extra/misshapen tensor, bad file, unknown model)."""
