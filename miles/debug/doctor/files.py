"""Opening only what can be read to its end: regular files (or links to them), never a FIFO, socket or
device node. Opening a FIFO waits for a writer that may never come; a device may never end. So every
path is `stat`ed first and skipped with a reason when it is not regular, and opened non-blocking in
case it was swapped in between.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

LOCK_NAME = ".miles.lock"  # a live `miles train` holds it in its run dir; a clean exit removes it
MAX_LOCK_BYTES = 64 << 10

_NOT_REGULAR = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                (stat.S_ISBLK, "block device"), (stat.S_ISDIR, "directory"))


def not_regular(path: Path) -> str | None:
    """None for a regular file (or a link to one); else why it is not read. Only `stat`, no `open`:
    opening a FIFO waits for a writer, a device may never end."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symbolic link" if os.path.islink(path) else "vanished while reading"
    except OSError as e:
        return e.strerror or type(e).__name__
    if stat.S_ISREG(mode):
        return None
    what = next((name for test, name in _NOT_REGULAR if test(mode)), "special file")
    return f"a {what}, not a regular file: not opened"


def open_regular(path: Path):
    """`open(path, "rb")` that cannot block: O_NONBLOCK, and a file that turned out not to be regular
    (replaced since `not_regular` looked) is closed unread."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(0, "not a regular file: not read")
    return os.fdopen(fd, "rb")


def read_lock(path: Path) -> dict | str | None:
    """A run's lock file: its JSON object, a string saying why it is unusable, or None if there is none."""
    if not os.path.lexists(path):
        return None
    why = not_regular(path)
    if why:
        return why
    try:
        with open_regular(path) as f:
            data = f.read(MAX_LOCK_BYTES)
        lock = json.loads(data)
    except OSError as e:
        return f"unreadable ({e.strerror or type(e).__name__})"
    except ValueError:
        return "not JSON"
    return lock if isinstance(lock, dict) else "not a JSON object"
