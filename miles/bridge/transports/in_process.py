"""`InProcessTransport`: the engine lives in this process; its tensors are copied into in place."""

from __future__ import annotations

import time

import torch

from miles.bridge.transports.base import WeightReceiver, WeightSource
from miles.bridge.weight_sync import SyncStats


class InProcessTransport:
    def __init__(self, receiver: WeightReceiver):
        self.receiver = receiver

    def send(self, source: WeightSource, step: int) -> SyncStats:
        start = time.perf_counter()
        named = source.named_weights()
        self.receiver.update_weights(named, weight_version=step)
        if named and named[0][1].is_cuda:
            torch.cuda.synchronize()
        return SyncStats(step=step, tensors=len(named), bytes=sum(t.numel() * t.element_size() for _, t in named),
                         seconds=time.perf_counter() - start)
