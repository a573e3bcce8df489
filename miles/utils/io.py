"""Atomic file writes: a reader never sees a half-written file, and every file gets the same mode.

`atomic_path(path)` is the one helper: it yields a temporary path beside `path`, and when the
block ends without an exception, gives it the run's readable mode and renames it over `path`.
The text/bytes/json writers and every other writer in miles (rollout dumps via `torch.save`,
bug bundles, reports, config.json) go through it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from miles.errors import UsageError


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, readable_mode())  # mkstemp makes 0600; a run's files are for everyone to read
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """A temporary dir beside `path` (`.NAME.tmp-*`) to fill; renamed over `path` when the block ends
    without an exception, removed otherwise. Readers never see a half-written dir."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        yield tmp
        os.chmod(tmp, readable_mode(directory=True))  # mkdtemp makes 0700
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def readable_mode(directory: bool = False) -> int:
    """0644 for files, 0755 for dirs, less whatever the umask takes away."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def check_model_dir(path: str | Path, flag: str) -> None:
    """A UsageError naming `flag` unless `path` holds a Hugging Face model's config.json."""
    if not Path(path, "config.json").is_file():
        raise UsageError(f"{flag} {path}: not a Hugging Face model dir (no config.json)")


def check_writable_dir(path: str | Path, flag: str) -> None:
    """A UsageError naming `flag` unless `path` is a directory this process can write, or could be
    created in one; nothing is left behind."""
    path = Path(path).absolute()
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"{flag} {path}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == path else f"cannot be created: {probe} is not writable"
        raise UsageError(f"{flag} {path} {what} by this user; pick a writable directory")
    try:  # the permission bits do not tell for root, read-only mounts or /proc: write a file that is never named
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        what = "" if probe == path else f" cannot be created: {probe}"
        raise UsageError(f"{flag} {path}{what} takes no new file ({e.strerror or e}); pick a writable directory") \
            from None
