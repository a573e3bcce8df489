"""The run's JSON Lines files (metrics.jsonl, hashes.jsonl): whole rows or nothing, one row per step.

`JsonlAppender.write(row)` appends one line with a single `write` on an O_APPEND descriptor; if
the disk fills mid-line the file is cut back to where it was and the error raised, so a reader
never sees a torn row. `reconcile(path, upto_step)` makes a file hold each step 1..K exactly once
before a resumed run appends step K+1: rows of later steps (a run that went on past its last
checkpoint, or an abandoned branch) and a torn last line are moved to `<file>.dropped` rather than
deleted.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from miles.utils.io import atomic_write_text


class JsonlAppender:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def write(self, row: dict) -> None:
        data = (json.dumps(row) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, data)
        except OSError as e:
            os.ftruncate(self._fd, size)
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        if written != len(data):  # a short write: the disk (or quota) is full
            os.ftruncate(self._fd, size)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    def close(self) -> None:
        os.close(self._fd)


def reconcile(path: str | Path, upto_step: int) -> str | None:
    """Keeps the rows of steps 1..upto_step (the first of each), and step 0's (the evaluation before
    the first step) when the run resumes after it; moves every other line to `<path>.dropped`;
    returns a note saying what moved, or None when nothing did."""
    path = Path(path)
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")
    kept, dropped, seen = [], [], set()
    for line in text.splitlines(keepends=True):
        step = _step_of(line)
        lowest = 0 if upto_step > 0 else 1  # a run starting over makes step 0 again
        if step is not None and lowest <= step <= upto_step and step not in seen and line.endswith("\n"):
            kept.append(line)
            seen.add(step)
        elif line.strip():
            dropped.append(line if line.endswith("\n") else line + "\n")
    if not dropped:
        return None
    with open(f"{path}.dropped", "a") as f:
        f.writelines(dropped)
    atomic_write_text(path, "".join(kept))
    return (f"{path.name}: kept the rows of steps 1..{upto_step}, moved {len(dropped)} other line(s) (later "
            f"steps of an interrupted run, duplicates or a torn line) to {path.name}.dropped")


def _step_of(line: str) -> int | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) else None
