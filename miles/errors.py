"""Errors that reach the user as one `error:` line (exit 2) instead of a traceback."""


class UsageError(Exception):
    """Bad flags or bad input. The message names the flag, file, line or key at fault and the fix.

    The CLI prints it as `error: <message>` on stderr and exits with status 2.
    """


class CheckFailed(Exception):
    """A check the user asked to be fatal failed (alignment, weight sync, determinism).

    The CLI prints it as `error: <message>` and exits with status 3.
    """
