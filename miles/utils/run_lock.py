"""One run per directory: an exclusive lock on `DIR/.miles.lock`, held for the life of the process.

The lock is an `fcntl.flock` on the file, which the kernel releases when the holding process dies,
however it dies (kill -9 included): a lock file left by a dead run is therefore simply taken over,
with a note naming the dead holder. The file holds its holder as JSON (pid, host, start time,
command line), so the refusal names who holds it and `miles doctor` can tell a live run from a
killed one. It is removed when the run ends normally. (flock is local to one host; on a shared
filesystem two hosts may each get it: the holder's host is recorded, and reported.)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from datetime import datetime
from pathlib import Path

from miles.errors import UsageError

LOCK_NAME = ".miles.lock"


class RunLock:
    def __init__(self, directory: str | Path, *, flag: str, command_line: str):
        self.path = Path(directory) / LOCK_NAME
        self.flag = flag  # which flag named the directory, for the error line
        self.command_line = command_line
        self._file = None

    def acquire(self) -> str | None:
        """Takes the lock; returns a note when it took over a dead run's lock file. Raises a
        UsageError naming the holder when a live process holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe(read_holder(self.path))
            f.close()
            raise UsageError(f"{self.flag} {self.path.parent} is in use by another miles run ({holder}); "
                             f"wait for it to finish, stop it, or pick another {self.flag}") from None
        previous = read_holder(self.path)
        f.seek(0)
        f.truncate()
        json.dump({"pid": os.getpid(), "host": socket.gethostname(),
                   "started": datetime.now().isoformat(timespec="seconds"), "command_line": self.command_line}, f)
        f.flush()
        self._file = f
        if previous:
            return f"took over the lock of a run that is gone ({describe(previous)})"
        return None

    def release(self) -> None:
        if self._file is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._file.close()  # closing releases the flock
        self._file = None


def read_holder(path: Path) -> dict:
    try:
        holder = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def describe(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    return (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}: "
            f"{holder.get('command_line', '')[:120]}")
