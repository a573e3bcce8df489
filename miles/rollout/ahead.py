"""`AheadRollouts` (--async): the next rollout is generated in the background while this one trains.

The one-step-ahead loop of Miles' `train_async.py`: the loop takes rollout k, `start`s rollout
k+1 on a background thread, trains on k, and `finish`es k+1 before the weights are synced (an
engine is never updated mid-generation). So rollout k+1 is made by the weights of step k-1: one
version stale, which each sample's `weight_version` records and `rollout/staleness` reports.

Resume stays exact: which prompts and random streams a rollout gets depend only on its id, and
the rollout made ahead is saved with the checkpoint of the step before it (`pending`), so a
resumed run trains on the very rollout the uninterrupted run would have.
"""

from __future__ import annotations

import logging
import threading

from miles.bridge.types import RolloutBatch, Sample
from miles.rollout.source import RolloutSource

logger = logging.getLogger("miles")


class AheadRollouts:
    def __init__(self, source: RolloutSource, *, pending: dict | None = None):
        """`pending`: a checkpoint's rollout made ahead (`pending_state`), trained first."""
        self.source = source
        self.ready: dict[int, RolloutBatch] = {}
        if pending is not None:
            self.ready[pending["rollout_id"]] = RolloutBatch([Sample(**s) for s in pending["samples"]],
                                                             dict(pending["stats"]))
            logger.info("--async: rollout %d was made ahead before the checkpoint; training on it as saved",
                        pending["rollout_id"])
        self._thread: threading.Thread | None = None
        self._running: int | None = None
        self._error: BaseException | None = None
        self._started = False

    def generate(self, rollout_id: int) -> RolloutBatch:
        if self._running == rollout_id:
            self.finish()
        if rollout_id in self.ready:
            return self.ready[rollout_id]
        return self.source.generate(rollout_id)

    def start(self, rollout_id: int) -> None:
        """Begins rollout `rollout_id` in the background (the previous one must be finished)."""
        if not self._started:
            logger.info("Continuous async rollout worker started: rollout k+1 is generated while training on k")
            self._started = True
        self._running, self._error = rollout_id, None
        self._thread = threading.Thread(target=self._run, args=(rollout_id,), name=f"rollout-{rollout_id}",
                                        daemon=True)
        self._thread.start()

    def _run(self, rollout_id: int) -> None:
        try:
            self.ready[rollout_id] = self.source.generate(rollout_id)
        except BaseException as e:  # re-raised in the loop's thread by finish()
            self._error = e

    def finish(self) -> None:
        """Waits for the background rollout; its error, if any, is raised here."""
        if self._thread is not None:
            self._thread.join()
            self._thread, self._running = None, None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def done_with(self, rollout_id: int) -> None:
        """Rollout `rollout_id` is trained on and recorded: forget it."""
        self.ready.pop(rollout_id, None)

    def pending_state(self, next_rollout_id: int) -> dict | None:
        """The finished rollout `next_rollout_id`, as plain data for trainer_state.pt (None if none)."""
        from miles.bridge.rollout_dump import plain

        batch = self.ready.get(next_rollout_id)
        if batch is None:
            return None
        return {"rollout_id": next_rollout_id, "samples": [plain(s.to_dict()) for s in batch.samples],
                "stats": dict(batch.stats)}
