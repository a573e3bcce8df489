"""Dump path templates (`dumps/data_{rollout_id}.pt`). Torch-free: checked with the flags."""

from __future__ import annotations

from pathlib import Path

from miles.errors import UsageError


def dump_path(template: str, rollout_id: int) -> Path:
    return Path(template.format(rollout_id=rollout_id))


def check_template(template: str, flag: str) -> None:
    """A template without {rollout_id} would write (or replay) one file for every rollout."""
    if "{rollout_id}" not in template:
        raise UsageError(f"{flag} {template}: the path must contain {{rollout_id}}, e.g. dumps/data_{{rollout_id}}.pt")
    try:
        template.format(rollout_id=0)
    except (KeyError, IndexError, ValueError) as e:
        raise UsageError(f"{flag} {template}: bad template ({e}); only {{rollout_id}} may appear in braces") from None
