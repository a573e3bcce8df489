"""What a run directory holds, read without torch (the CLI decides before importing it)."""

from __future__ import annotations

import re
from pathlib import Path

TRAINER_STATE = "trainer_state.pt"
STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dirs(root: str | Path) -> dict[int, Path]:
    """The complete `step_N` dirs (those holding trainer_state.pt) directly under `root`, by N."""
    root = Path(root)
    if not root.is_dir():
        return {}
    return {int(m.group(1)): d for d in root.iterdir()
            if (m := STEP_DIR.match(d.name)) and (d / TRAINER_STATE).is_file()}


def holds_rows(output_dir: str | Path) -> bool:
    rows = Path(output_dir) / "metrics.jsonl"
    return rows.is_file() and rows.stat().st_size > 0
