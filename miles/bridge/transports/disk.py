"""`DiskTransport`: the trainer's weights written once, loaded by every server.

Each sync writes the policy in HF layout (safetensors, tied weights once, config.json) under
`directory/step_N`, atomically (a server never loads a half-written file), asks the receiver (a
`RemoteEngine`: every server) to load it with the step as weight_version, then deletes the
previous step's copy: one copy of the weights on disk at a time.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Protocol

import torch

from miles.bridge.weight_sync import SyncStats
from miles.utils.io import atomic_dir


class DiskWeightReceiver(Protocol):
    def load_weights_from_disk(self, path: str, *, weight_version: int) -> None: ...


class DiskTransport:
    """`untie`: write a tied output layer as its own `lm_head.weight` too (for engines that load the
    model untied: vLLM, see miles/rollout/remote/untie.py)."""

    def __init__(self, receiver: DiskWeightReceiver, directory: str | Path, *, untie: bool = False):
        self.receiver, self.directory, self.untie = receiver, Path(directory), untie
        self._previous: Path | None = None

    def send(self, model: torch.nn.Module, step: int) -> SyncStats:
        start = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"step_{step}"
        with atomic_dir(path) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            if self.untie:
                _write_untied(model, tmp)
        self.receiver.load_weights_from_disk(str(path), weight_version=step)
        if self._previous is not None and self._previous != path:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = path
        named = list(model.named_parameters())
        return SyncStats(step=step, tensors=len(named), bytes=sum(p.numel() * p.element_size() for _, p in named),
                         seconds=time.perf_counter() - start)


def _write_untied(model: torch.nn.Module, directory: Path) -> None:
    """Every parameter by its own name, the tied output layer as `lm_head.weight` beside the
    embedding, in one file, with an untied config."""
    import json

    from safetensors.torch import save_file

    for f in directory.glob("model*.safetensors*"):
        f.unlink()
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    if "lm_head.weight" in tensors:
        tensors["lm_head.weight"] = tensors["lm_head.weight"].clone()  # its own storage: safetensors needs that
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
