"""Trainer -> engine weight sync: the interface, and the transfer that logs `weight_sync`.

An engine is a `WeightReceiver`: anything with `update_weights(named_tensors)`. miles' local
engine copies the tensors in process; a remote engine (SGLang's `/update_weights_from_disk`, or
a broadcast group) implements the same one method.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

logger = logging.getLogger("miles")


class WeightReceiver(Protocol):
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


@dataclass
class SyncStats:
    step: int
    tensors: int
    bytes: int
    seconds: float


def sync_weights(model: torch.nn.Module, receiver: WeightReceiver, step: int) -> SyncStats:
    """Sends every parameter of `model` to `receiver` and logs one `weight_sync` line."""
    start = time.perf_counter()
    named = [(name, p.detach()) for name, p in model.named_parameters()]
    receiver.update_weights(named)
    if named and named[0][1].is_cuda:
        torch.cuda.synchronize()
    stats = SyncStats(step, len(named), sum(t.numel() * t.element_size() for _, t in named),
                      time.perf_counter() - start)
    logger.info("weight_sync step=%d tensors=%d bytes=%d time_ms=%.1f", stats.step, stats.tensors, stats.bytes,
                stats.seconds * 1e3)
    return stats
