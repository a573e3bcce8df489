"""Checkpoints: `step_N/` dirs in HF format (safetensors + tokenizer) plus `trainer_state.pt`.

A step dir is written under a temporary name (`.step_N.tmp-*`) and renamed when complete, so
`--load` never picks up a half-written checkpoint; a checkpoint holding a NaN/Inf tensor is
refused before anything is written. `trainer_state.pt` holds plain tensors and dicts only (the
optimizer state, the step, a fingerprint of the prompt data, the run's config, every RNG state)
and loads with `torch.load(weights_only=True)`.

A save root holds one lineage: `step_N` dirs of one run. Resuming from an older step into it
would mix two (`newer_steps`); `abandon` moves the newer ones aside when the user asks for a
branch. `prune` keeps the newest N (`--keep-checkpoints`); `clean_temporaries` removes what a
killed save left behind.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from datetime import datetime
from pathlib import Path

import torch

from miles.bridge.transports.disk import write_hf_weights
from miles.errors import CheckFailed, UsageError
from miles.utils.io import atomic_dir
from miles.utils.run_dirs import TRAINER_STATE, step_dirs

logger = logging.getLogger("miles")

_TEMP_DIR = re.compile(r"^\.step_\d+\.tmp-")


def save_checkpoint(root: str | Path, step: int, model, tokenizer, trainer_state: dict,
                    state_dict: dict | None = None) -> Path:
    """`state_dict`: the model's whole tensors when they are not its own (gathered shards)."""
    state_dict = model.state_dict() if state_dict is None else state_dict
    bad = next((name for name, t in state_dict.items()
                if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
    if bad is not None:
        raise CheckFailed(f"not saving checkpoint step_{step}: tensor {bad} holds NaN/Inf values (the last "
                          f"checkpoint on disk is untouched); the weights were loaded that way or a step went wrong")
    target = Path(root) / f"step_{step}"
    with atomic_dir(target) as tmp:  # `.step_N.tmp-*` until complete
        write_hf_weights(model, state_dict, tmp)
        tokenizer.save_pretrained(tmp)
        torch.save({**trainer_state, "step": step}, tmp / TRAINER_STATE)
    logger.info("Saved checkpoint to %s", target)
    return target


def find_latest_checkpoint(path: str | Path) -> Path:
    """`path` is one `step_N` dir, a dir of them, or a run dir holding `checkpoints/`; returns the
    complete checkpoint with the largest N."""
    path = Path(path)
    if (path / TRAINER_STATE).is_file():
        return path
    if (path / "checkpoints").is_dir() and not step_dirs(path):
        path = path / "checkpoints"
    steps = step_dirs(path)
    if not steps:
        raise UsageError(f"--load {path}: no complete checkpoint (step_N/ with {TRAINER_STATE}) found there")
    return steps[max(steps)]


def load_trainer_state(checkpoint: Path) -> dict:
    path = Path(checkpoint) / TRAINER_STATE
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # truncated, garbage, or a pickle of arbitrary objects
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UsageError(f"--load {checkpoint}: {path} is not a readable trainer state ({reason}); resume from "
                         f"another step_N, or restart the run") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "optimizer" not in state:
        raise UsageError(f"--load {checkpoint}: {path} is not a miles trainer state (expected a dict with 'step' "
                         f"and 'optimizer'); resume from another step_N, or restart the run")
    return state


def newer_steps(root: str | Path, step: int) -> list[int]:
    """Steps of `root` after `step`: a resume from `step` into `root` would start a second lineage."""
    return sorted(n for n in step_dirs(root) if n > step)


def abandon(root: str | Path, after: int) -> Path:
    """Moves the step dirs after `after` into `root/abandoned-after-step_K-<time>/` (kept, not
    deleted; no longer seen by --load). Returns that dir."""
    root = Path(root)
    aside = root / f"abandoned-after-step_{after}-{datetime.now():%Y%m%d-%H%M%S}"
    aside.mkdir()
    for n in newer_steps(root, after):
        os.replace(root / f"step_{n}", aside / f"step_{n}")
    return aside


def prune(root: str | Path, keep: int) -> list[int]:
    """Deletes all but the newest `keep` step dirs; returns the steps deleted."""
    steps = sorted(step_dirs(root))
    gone = steps[:-keep] if keep > 0 else []
    for n in gone:
        shutil.rmtree(Path(root) / f"step_{n}")
    return gone


def clean_temporaries(root: str | Path) -> int:
    """Removes `.step_N.tmp-*` dirs left by a save that was killed; returns the bytes freed."""
    root = Path(root)
    freed = 0
    for d in (root.iterdir() if root.is_dir() else ()):
        if d.is_dir() and _TEMP_DIR.match(d.name):
            freed += sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            shutil.rmtree(d, ignore_errors=True)
    return freed


class Checkpointer:
    """When and what to save: every `interval` steps and at the last one, plus on request (a stop);
    the newest `keep` kept. `save_fn(root, step, extra_state)` writes one checkpoint (the trainer's);
    `extra_state()` is what goes into trainer_state.pt beside the optimizer (config, data, RNG)."""

    def __init__(self, save_fn, *, root: str | Path, interval: int | None, keep: int | None, last_step: int,
                 saved_step: int, extra_state):
        self.save_fn, self.root, self.interval, self.keep = save_fn, Path(root), interval, keep
        self.last_step = last_step
        self.saved_step = saved_step  # the newest step on disk (the resumed-from step, or 0)
        self.extra_state = extra_state

    def after_step(self, step: int) -> None:
        if step == self.last_step or (self.interval and step % self.interval == 0):
            self.save(step)

    def save(self, step: int) -> Path | None:
        if step <= 0 or step == self.saved_step:
            return None
        path = self.save_fn(self.root, step, self.extra_state())
        self.saved_step = step
        if self.keep:
            if gone := prune(self.root, self.keep):
                logger.info("--keep-checkpoints %d: deleted %s", self.keep, ", ".join(f"step_{n}" for n in gone))
        return path
