"""Helpers shared by the benchmark scripts: run `miles train` in process, read its metrics."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from miles.cli.main import main


def train(argv: list[str]) -> list[dict]:
    """Runs `miles train ARGV` (which must hold --output-dir) and returns its metrics rows."""
    assert main(["train", *argv]) == 0
    out = Path(argv[argv.index("--output-dir") + 1])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def steady(rows: list[dict], key: str) -> float:
    """Mean of KEY over steps 2.. (step 1 carries one-off warm-up), or over all if there is one."""
    values = [r[key] for r in (rows[1:] if len(rows) > 1 else rows) if key in r]
    return statistics.fmean(values) if values else float("nan")
