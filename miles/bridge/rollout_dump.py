"""Rollout dumps: the `Sample`s of one rollout on disk (`--save-debug-rollout-data`), and reading them back.

One file per rollout id, written atomically, readable with `torch.load(path, weights_only=True)`:

    {"format": "miles.rollout/1", "rollout_id": int, "samples": [sample dict, ...], "metadata": {...}}

Dumps written by Miles or slime (`{"rollout_id", "samples": [Sample.to_dict()]}`) load too: their
extra fields are ignored and the ones miles needs but they may lack (loss masks, group indices,
engine log-probs) are filled in or reported as missing. `miles.rollout.replay.ReplaySource` replays
them as a rollout source; `miles inspect-rollout` and `miles report` read them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from miles.bridge.types import Sample
from miles.bridge.dump_paths import dump_path
from miles.errors import UsageError
from miles.utils.io import atomic_path

logger = logging.getLogger("miles")

FORMAT = "miles.rollout/1"
LOAD_FLAG = "--load-debug-rollout-data"


def save_rollout(template: str, rollout_id: int, samples: list[Sample], metadata: dict[str, Any]) -> Path:
    path = dump_path(template, rollout_id)
    payload = {"format": FORMAT, "rollout_id": rollout_id, "samples": [s.to_dict() for s in samples],
               "metadata": metadata}
    with atomic_path(path) as tmp:  # a reader never sees a half-written dump
        torch.save(payload, tmp)
    return path


def read_dump(path: Path, source: str = LOAD_FLAG) -> dict[str, Any]:
    """Loads one dump file; any failure is a UsageError naming the file (and `source`, the flag
    or command that asked for it)."""
    if not path.is_file():
        raise UsageError(f"{source}: {path} does not exist; capture rollouts with --save-debug-rollout-data "
                         f"(with --debug-rollout-only to skip training)")
    try:
        payload = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # truncated zip, garbage bytes, a pickle of arbitrary objects, ...
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise UsageError(f"{path}: not a readable rollout dump ({reason}); re-capture it with "
                         f"--save-debug-rollout-data") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("samples"), list):
        got = f"keys {sorted(map(str, payload))}" if isinstance(payload, dict) else type(payload).__name__
        raise UsageError(f"{path}: not a rollout dump (expected a dict with a 'samples' list; got {got})")
    if not payload["samples"]:
        raise UsageError(f"{path}: the dump holds no samples")
    return payload


def samples_from_dump(payload: dict[str, Any], path: Path, n_samples_per_prompt: int) -> list[Sample]:
    return [_to_sample(d, i, path, n_samples_per_prompt) for i, d in enumerate(payload["samples"])]


def _to_sample(d: Any, i: int, path: Path, n_samples_per_prompt: int) -> Sample:
    """A miles sample dict, or a Miles/slime `Sample.to_dict()`, as a miles `Sample`."""
    if not isinstance(d, dict):
        raise UsageError(f"{path}: sample {i} is a {type(d).__name__}, not a dict")
    d = {k: _plain(v) for k, v in d.items()}
    for key in ("tokens", "response_length"):
        if d.get(key) is None:
            raise UsageError(f"{path}: sample {i} has no '{key}'; it cannot be trained on")
    tokens, response_length = list(d["tokens"]), int(d["response_length"])
    if not 0 < response_length <= len(tokens):
        raise UsageError(f"{path}: sample {i} has response_length {response_length} but {len(tokens)} tokens")
    reward = d.get("reward")
    if isinstance(reward, dict):  # slime stores a dict when the reward model returns several keys
        numbers = [v for v in reward.values() if isinstance(v, (int, float))]
        if len(numbers) != 1:
            raise UsageError(f"{path}: sample {i} has a reward dict {sorted(reward)}; miles needs one number")
        reward = numbers[0]
    log_probs = d.get("rollout_log_probs") or []
    return Sample(
        group_index=d["group_index"] if d.get("group_index") is not None else i // n_samples_per_prompt,
        index=d["index"] if d.get("index") is not None else i,
        prompt=d.get("prompt") or "",
        tokens=tokens,
        response=d.get("response") or "",
        response_length=response_length,
        label=d.get("label"),
        reward=float(reward) if reward is not None else 0.0,
        loss_mask=list(d["loss_mask"]) if d.get("loss_mask") is not None else [1] * response_length,
        rollout_log_probs=list(log_probs),
        status=str(d.get("status") or "completed"),
        weight_version=_weight_version(d),
        metadata=d.get("metadata") or {},
    )


def _weight_version(d: dict) -> int | None:
    """miles' `weight_version`; slime's `weight_versions` lists one per turn: the first made the response."""
    if isinstance(d.get("weight_version"), int):
        return d["weight_version"]
    versions = d.get("weight_versions")
    if isinstance(versions, list) and versions:
        try:
            return int(versions[0])
        except (TypeError, ValueError):
            return None
    return None


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, torch.Tensor) else value


def check_fits(samples: list[Sample], path: Path, *, vocab_size: int, expected: int, needs_log_probs: bool) -> None:
    """The dump must fit the model (token ids) and the batch flags (sample count)."""
    top = max(max(s.tokens) for s in samples)
    if top >= vocab_size:
        raise UsageError(f"{path}: token id {top} is outside the model's vocabulary ({vocab_size} tokens); the dump "
                         f"was made with another model: replay it with the --hf-checkpoint that captured it")
    if len(samples) != expected:
        raise UsageError(f"{path} holds {len(samples)} samples but --rollout-batch-size x --n-samples-per-prompt is "
                         f"{expected}; set them to the capture's values")
    if any(len(s.rollout_log_probs) != s.response_length for s in samples) and needs_log_probs:
        raise UsageError(f"{path}: samples have no engine log-probs (rollout_log_probs), which --use-tis needs; "
                         f"drop --use-tis or re-capture with miles")
