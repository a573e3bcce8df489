"""`DiskTransport`: the trainer's weights written once, loaded by every server.

Each sync has the source (the trainer: rank 0 of a sharded one) write the policy in HF layout
(safetensors, tied weights once, config.json) under
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

from miles.bridge.transports.base import WeightSource
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

    def send(self, source: WeightSource, step: int) -> SyncStats:
        start = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"step_{step}"
        with atomic_dir(path) as tmp:
            tensors, nbytes = source.write_hf(tmp, untie=self.untie)
        self.receiver.load_weights_from_disk(str(path), weight_version=step)
        if self._previous is not None and self._previous != path:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = path
        return SyncStats(step=step, tensors=tensors, bytes=nbytes, seconds=time.perf_counter() - start)


def write_hf_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], directory: Path, *,
                     untie: bool = False) -> tuple[int, int]:
    """`state_dict` (whole tensors) in `model`'s HF layout into `directory`: safetensors, tied
    weights once, config.json. Returns (parameters, bytes) written."""
    # A copy: save_pretrained drops tied keys from the dict it is given.
    model.save_pretrained(directory, state_dict=dict(state_dict), safe_serialization=True)
    if untie:
        _write_untied(model, state_dict, directory)
    unique = {t.data_ptr(): t for t in state_dict.values()}  # a tied tensor once
    return len(unique), sum(t.numel() * t.element_size() for t in unique.values())


def _write_untied(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], directory: Path) -> None:
    """Every tensor by its own name, the tied output layer as `lm_head.weight` beside the
    embedding, in one file, with an untied config."""
    import json

    from safetensors.torch import save_file

    for f in directory.glob("model*.safetensors*"):
        f.unlink()
    tensors = {name: t.detach().contiguous().cpu() for name, t in state_dict.items()}
    if "lm_head.weight" not in tensors:  # a gathered state dict may hold a tied weight once
        embedding = next(f"{name}.weight" for name, m in model.named_modules() if m is model.get_input_embeddings())
        tensors["lm_head.weight"] = tensors[embedding]
    tensors["lm_head.weight"] = tensors["lm_head.weight"].clone()  # its own storage: safetensors needs that
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
