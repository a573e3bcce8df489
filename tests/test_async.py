"""--async: rollout k+1 is generated while rollout k trains (one process: a background thread)."""

from __future__ import annotations

import json
from pathlib import Path

from miles.cli.main import main


def rows(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def test_async_is_one_step_ahead(tiny_args, tmp_path):
    run = tmp_path / "run"
    dumps = str(tmp_path / "dumps" / "rollout_{rollout_id}.pt")
    assert main(tiny_args + ["--num-rollout", "3", "--async", "--save-debug-rollout-data", dumps]) == 0
    log = (run / "train.log").read_text()
    assert log.count("Continuous async rollout worker started") == 1
    metrics = rows(run)
    # Rollout 0 comes from the initial weights, as in a sync run; each later one from the weights
    # one step behind the trainer's.
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 1.0]
    assert all("perf/async_wait_s" in m for m in metrics)
    import torch

    versions = [{s["weight_version"] for s in torch.load(tmp_path / "dumps" / f"rollout_{i}.pt",
                                                         weights_only=False)["samples"]} for i in range(3)]
    assert versions == [{0}, {0}, {1}]


def test_sync_runs_have_no_staleness(tiny_args, tmp_path):
    assert main(tiny_args) == 0
    assert [m["rollout/staleness"] for m in rows(tmp_path / "run")] == [0.0, 0.0]


def test_async_resume_trains_the_rollout_made_ahead(tiny_args, tmp_path):
    """A run resumed from step 1 of an --async run makes steps 2 and 3 bitwise as it did: the rollout
    made ahead before the checkpoint is saved with it and trained on as saved."""
    whole, resumed = tmp_path / "run", tmp_path / "resumed"
    flags = ["--num-rollout", "3", "--async", "--debug-determinism", "--save-interval", "1"]
    assert main(tiny_args + flags) == 0
    out = tiny_args.index("--output-dir")
    again = tiny_args[:out] + tiny_args[out + 2:] + flags + ["--output-dir", str(resumed), "--load",
                                                             str(whole / "checkpoints" / "step_1")]
    assert main(again) == 0
    assert "rollout 1 was made ahead before the checkpoint" in (resumed / "train.log").read_text()
    assert rows(resumed, "hashes.jsonl") == rows(whole, "hashes.jsonl")[1:]
