"""Turns on a shared device (`--colocate`): the trainer and the engines are never both at full size.

  for_rollout:  engines take their memory back, then the trainer offloads to CPU
  for_training: engines release theirs (weights and KV cache), then the trainer loads back
  for_sync:     both loaded: engines take theirs back while the trainer stays (weights go from one
                to the other; a checkpoint gathers from the trainer's devices); the trainer
                offloads at the next `for_rollout`

Each call is a no-op when already in that state. Without --colocate the loop holds `Apart`,
whose calls do nothing.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("miles")


class Apart:
    """Trainer and engines on their own devices: nothing to hand over."""

    def for_rollout(self) -> None: ...

    def for_training(self) -> None: ...

    def for_sync(self) -> None: ...

    def take_seconds(self) -> float:
        return 0.0


class Colocated(Apart):
    def __init__(self, trainer, engine):
        self.trainer, self.engine = trainer, engine
        self.trainer_loaded, self.engine_loaded = True, True
        self.seconds = 0.0  # time spent handing the device over, this step

    def for_rollout(self) -> None:
        self._turn(engine=True, trainer=False)

    def for_training(self) -> None:
        self._turn(engine=False, trainer=True)

    def for_sync(self) -> None:
        self._turn(engine=True, trainer=True)

    def _turn(self, *, engine: bool, trainer: bool) -> None:
        """Brings each side to loaded or not, the engine first (it frees or takes the room the
        trainer then takes or frees)."""
        start = time.perf_counter()
        if self.engine_loaded != engine:
            (self.engine.resume_memory if engine else self.engine.release_memory)()
            self.engine_loaded = engine
        if self.trainer_loaded != trainer:
            (self.trainer.onload if trainer else self.trainer.offload)()
            self.trainer_loaded = trainer
        self.seconds += time.perf_counter() - start

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds
