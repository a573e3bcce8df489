"""A progress bar for generation and training that stays out of logs.

It draws (with rich, on stderr) only when stderr is a terminal, and disappears when the work is
done, so `train.log`, pipes and CI output keep only the one summary line per step.
"""

from __future__ import annotations

import sys

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as _RichProgress


class Progress:
    def __init__(self, description: str, total: int):
        self._bar = None
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
        if self._bar is not None:
            self._bar.update(self._task, completed=completed)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)
