"""Errors a user can fix. The CLI prints their one-line message (no traceback) and exits 2."""


class UserError(Exception):
    """Bad input, a missing backend, a broken checkpoint: one line naming the problem and the fix."""

    exit_code = 2
