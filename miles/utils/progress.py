"""Progress of the long phases (generation, training), on a terminal or in a log.

On a terminal (stderr a TTY) it draws a rich progress bar on stderr that disappears when the work
is done, so `train.log` keeps only the one summary line per step. Without a terminal (output
redirected, CI, a cluster job) it logs a plain line every `PLAIN_INTERVAL_S` seconds instead,
e.g. `rollout 3 generating: 180/512 tokens, 60s`, so a long phase is never silent.
"""

from __future__ import annotations

import logging
import sys
import time

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as _RichProgress

logger = logging.getLogger("miles")

PLAIN_INTERVAL_S = 30.0


class Progress:
    def __init__(self, description: str, total: int, unit: str = "steps"):
        self.description, self.total, self.unit = description, total, unit
        self.completed = 0
        self._bar = None
        self._start = self._last_line = time.monotonic()
        if sys.stderr.isatty():
            self._bar = _RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), transient=True)
            self._task = self._bar.add_task(description, total=total)

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update_to(self, completed: int) -> None:
        self.completed = completed
        if self._bar is not None:
            self._bar.update(self._task, completed=completed)
            return
        now = time.monotonic()
        if now - self._last_line >= PLAIN_INTERVAL_S:
            self._last_line = now
            logger.info("%s: %d/%d %s, %.0fs", self.description, completed, self.total, self.unit, now - self._start)

    def advance(self, n: int = 1) -> None:
        self.update_to(self.completed + n)
