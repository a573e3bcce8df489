"""The protocols: a transport sends a source's weights; a receiver is whatever loads them.

A `WeightSource` is the trainer side (a `Trainer`, or a group of sharded ranks behind one): it
hands out whole tensors or writes them in HF layout, so that no transport knows about sharding.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from miles.bridge.weight_sync import SyncStats

if TYPE_CHECKING:
    import torch


class WeightSource(Protocol):
    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(name, whole tensor) of every parameter, in `named_parameters()` order."""
        ...

    def write_hf(self, directory: Path, *, untie: bool = False) -> tuple[int, int]:
        """The policy in HF layout into `directory`; returns (tensors, bytes) written."""
        ...


class ModelWeights:
    """A `WeightSource` over a model in this process, unsharded."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, p.detach()) for name, p in self.model.named_parameters()]

    def write_hf(self, directory: Path, *, untie: bool = False) -> tuple[int, int]:
        from miles.bridge.transports.disk import write_hf_weights

        return write_hf_weights(self.model, self.model.state_dict(), directory, untie=untie)


class WeightTransport(Protocol):
    def send(self, source: WeightSource, step: int) -> SyncStats:
        """Sends every parameter of `source` (the weights after optimizer step `step`)."""
        ...


class WeightReceiver(Protocol):
    """The receiving end an in-process transport writes into (an `Engine` is one)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, weight_version: int) -> None: ...
