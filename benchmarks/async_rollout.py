"""Step time of `miles train` with and without --async, same flags, side by side, in one run.

    python benchmarks/async_rollout.py [--repeats 3 --num-rollout 5] [-- EXTRA MILES FLAGS]

Each repeat runs the sync and the --async variant back to back (alternating which goes first), on
the demo model and task unless the extra flags say otherwise. The first step is left out of each
run's mean (nothing is ahead of it yet, and it pays the warm-up). Prints every run's mean step
time, then per variant the median, min and max over repeats, and the async/sync ratio of medians
with its worst case (slowest async over fastest sync).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(flags: list[str], output: Path) -> float:
    command = [sys.executable, "-m", "miles", "train", *flags, "--output-dir", str(output)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return statistics.mean(r["perf/step_time_s"] for r in rows[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-rollout", type=int, default=5)
    p.add_argument("extra", nargs="*", help="flags passed to both runs (after --)")
    a = p.parse_args()
    base = ["--num-rollout", str(a.num_rollout), "--alignment-check", "off", *a.extra]
    times: dict[str, list[float]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            order = ["sync", "async"] if i % 2 == 0 else ["async", "sync"]
            for variant in order:
                flags = base + (["--async"] if variant == "async" else [])
                seconds = run(flags, Path(tmp) / f"{variant}-{i}")
                times[variant].append(seconds)
                print(f"repeat {i + 1} {variant:5s}: {seconds:.2f} s/step (steps 2..{a.num_rollout})", flush=True)
    print(f"\nflags: {' '.join(base)}")
    for variant, ts in times.items():
        print(f"{variant:5s}  median {statistics.median(ts):.2f} s/step  min {min(ts):.2f}  max {max(ts):.2f}")
    ratio = statistics.median(times["async"]) / statistics.median(times["sync"])
    worst = max(times["async"]) / min(times["sync"])
    print(f"async/sync step time: {ratio:.3f} (median), {worst:.3f} (worst case)")


if __name__ == "__main__":
    main()
