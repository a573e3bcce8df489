"""Checkpoints: `step_N/` dirs in HF format (safetensors + tokenizer) plus `trainer_state.pt`.

A step dir is written under a temporary name and renamed when complete, so `--load` never picks
up a half-written checkpoint. `trainer_state.pt` holds plain tensors and dicts only (the optimizer
state, the step, a fingerprint of the prompt data, the run's config; no RNG state) and loads with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from miles.errors import UsageError
from miles.utils.io import readable_mode

logger = logging.getLogger("miles")

TRAINER_STATE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def save_checkpoint(root: str | Path, step: int, model, tokenizer, trainer_state: dict) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"step_{step}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".step_{step}.tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save({**trainer_state, "step": step}, tmp / TRAINER_STATE)
        os.chmod(tmp, readable_mode(directory=True))  # mkdtemp makes 0700
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Saved checkpoint to %s", target)
    return target


def find_latest_checkpoint(path: str | Path) -> Path:
    """`path` is one `step_N` dir, a dir of them, or a run dir holding `checkpoints/`; returns the
    complete checkpoint with the largest N."""
    path = Path(path)
    if (path / TRAINER_STATE).is_file():
        return path
    if (path / "checkpoints").is_dir() and not any(_STEP_DIR.match(d.name) for d in path.iterdir()):
        path = path / "checkpoints"
    steps = [(int(m.group(1)), d) for d in path.iterdir()
             if (m := _STEP_DIR.match(d.name)) and (d / TRAINER_STATE).is_file()]
    if not steps:
        raise UsageError(f"--load {path}: no complete checkpoint (step_N/ with {TRAINER_STATE}) found there")
    return max(steps)[1]


def load_trainer_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / TRAINER_STATE, weights_only=True, map_location="cpu")
