"""Errors of checkpoint loading: one line naming the tensor or file, and the fix."""

from __future__ import annotations

from deepinfer.errors import UserError


class LoadError(UserError):
    """A checkpoint or config that cannot be loaded (missing/extra/misshapen tensor, bad file, unknown model).

    `problem` says what is wrong, `fix` what to do; the message is "problem; fix".
    """

    def __init__(self, problem: str, fix: str | None = None):
        super().__init__(f"{problem}; {fix}" if fix else problem)
        self.problem = problem
        self.fix = fix


class CheckpointError(LoadError):
    """Something in the model folder's files is broken or inconsistent (a bad config field, a
    truncated shard, a tensor of the wrong shape). The loader replaces the fix for the embedded
    model, whose folder is generated locally: deleting it regenerates it, re-downloading does not apply."""
