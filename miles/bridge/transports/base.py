"""The protocols: a transport sends a model's weights; a receiver is whatever loads them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from miles.bridge.weight_sync import SyncStats

if TYPE_CHECKING:
    import torch


class WeightTransport(Protocol):
    def send(self, model: torch.nn.Module, step: int) -> SyncStats:
        """Sends every parameter of `model` (the weights after optimizer step `step`)."""
        ...


class WeightReceiver(Protocol):
    """The receiving end an in-process transport writes into (an `Engine` is one)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, weight_version: int) -> None: ...
