"""SIGTERM / SIGINT during `miles train`: stop at a step boundary, so the last finished step can be saved.

Outside a `deferred()` block (generation, which holds no training state) a signal stops the run
at once by raising `Stopped`; inside one (training, syncing, saving: a step's updates must land
whole) it is held until the block ends. A second signal raises at once wherever the run is, marked
`immediate`: the step in progress is then lost.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

from miles.errors import Stopped

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    def __init__(self):
        self.pending: signal.Signals | None = None
        self._deferring = 0
        self._previous = {}

    def install(self) -> None:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        sig = signal.Signals(signum)
        if self.pending is not None:
            raise Stopped(sig.name, sig.value, immediate=True)
        self.pending = sig
        if not self._deferring:
            raise Stopped(sig.name, sig.value)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if self.pending is not None and not self._deferring:
            raise Stopped(self.pending.name, self.pending.value)
