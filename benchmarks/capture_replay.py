"""What capture costs and what replay saves, measured on one recipe in one process.

Runs the recipe live with `--save-debug-rollout-data` (step time, dump time), then replays the
dumps with `--load-debug-rollout-data` (step time without generation), and prints both side by
side. Defaults to the demo recipe (demo model, bundled task); extra flags go to `miles train`.

    python benchmarks/capture_replay.py [--steps 3] [miles train flags...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import steady, train


def bench(steps: int, extra: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        template = str(tmp / "dumps" / "data_{rollout_id}.pt")
        base = ["--num-rollout", str(steps), *extra]
        live = train(base + ["--save-debug-rollout-data", template, "--output-dir", str(tmp / "live")])
        replay = train(base + ["--load-debug-rollout-data", template, "--output-dir", str(tmp / "replay")])
        dump_mib = sum(p.stat().st_size for p in (tmp / "dumps").glob("*.pt")) / steps / 2**20

    live_step, replay_step = steady(live, "perf/step_time_s"), steady(replay, "perf/step_time_s")
    dump_s = steady(live, "perf/rollout_dump_s")
    print(f"steady steps (2..{steps}); step 1 is warm-up")
    print(f"{'':34}{'live + capture':>16}{'replay':>10}")
    print(f"{'step time (s)':34}{live_step:>16.3f}{replay_step:>10.3f}")
    print(f"{'  generation (s)':34}{steady(live, 'perf/rollout_time_s'):>16.3f}{0:>10.3f}")
    print(f"{'  weight sync (s)':34}{steady(live, 'perf/weight_sync_s'):>16.3f}{0:>10.3f}")
    print(f"{'  writing the dump (s)':34}{dump_s:>16.4f}{'-':>10}")
    print(f"capture cost: {dump_s * 1e3:.1f} ms a step = {100 * dump_s / live_step:.2f}% of the step; "
          f"{dump_mib:.3f} MiB a dump")
    print(f"replay saves: {live_step - replay_step:.3f} s a step = {100 * (1 - replay_step / live_step):.1f}% "
          f"({live_step / replay_step:.2f}x the live step rate)")
    same = all(a["train/loss"] == b["train/loss"] and a["train/grad_norm"] == b["train/grad_norm"]
               for a, b in zip(live, replay))
    print(f"replayed loss and grad_norm identical to live: {same}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    known, extra = ap.parse_known_args()
    bench(known.steps, extra)
