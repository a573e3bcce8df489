"""Errors that reach the user as one `error:` line instead of a traceback, and the stop by signal."""


class UsageError(Exception):
    """Bad flags or bad input. The message names the flag, file, line or key at fault and the fix.

    The CLI prints it as `error: <message>` on stderr and exits with status 2.
    """


class CheckFailed(Exception):
    """A check the user asked to be fatal failed (alignment, weight sync, determinism, non-finite
    values). The CLI prints it as `error: <message>` and exits with status 3.
    """


class RunFailed(Exception):
    """The environment failed the run (disk full, a directory turned read-only). The CLI prints it
    as `error: <message>` and exits with status 1."""


class WorkerCrashed(RunFailed):
    """A Ray-hosted worker (a trainer rank, an engine) died or failed: the message names which one,
    its node and its first error. Exit status 1, like any failure of the environment."""


class Stopped(BaseException):
    """SIGTERM or SIGINT stopped the run. A BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way (a reward function's, say) swallows it. Exit status 128 + signal."""

    def __init__(self, signal_name: str, signal_number: int, immediate: bool = False):
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.exit_code = 128 + signal_number
        self.immediate = immediate  # a second signal: stop now, even in the middle of a step
