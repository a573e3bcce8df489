"""What bitwise reproducibility costs: the same recipe plain, with --deterministic-mode, with
--deterministic-mode --debug-determinism (per-step hashes), and with --true-on-policy-mode, side by
side; then whether two deterministic runs hash identically at every step, and the true on-policy
run's engine/trainer log-prob gap (0.0 means bitwise equal).

    python benchmarks/determinism_cost.py [--steps 4] [miles train flags...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import steady, train

from miles.cli.main import main as miles


def bench(steps: int, extra: list[str]) -> None:
    setups = {"default": [], "deterministic": ["--deterministic-mode"],
              "deterministic + hashes": ["--deterministic-mode", "--debug-determinism"],
              "true on-policy": ["--true-on-policy-mode"]}
    results, gaps = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in setups.items():
            rows = train(["--num-rollout", str(steps), *extra, *flags, "--output-dir", str(Path(tmp) / name)])
            results[name] = steady(rows, "perf/step_time_s")
            gaps[name] = max(r["forward_logp_max_diff"] for r in rows)
        again = Path(tmp) / "again"
        train(["--num-rollout", str(steps), *extra, *setups["deterministic + hashes"], "--output-dir", str(again)])
        print(f"steady steps 2..{steps}; flags: {' '.join(extra) or '(demo recipe)'}")
        base = results["default"]
        for name, t in results.items():
            print(f"{name:26}{t:>10.3f} s/step{100 * (t / base - 1):>+9.1f}%")
        identical = miles(["diff-runs", str(Path(tmp) / "deterministic + hashes"), str(again)]) == 0
        print(f"two deterministic runs hash identically at every step: {identical}")
        print(f"max forward_logp_max_diff over the run: default {gaps['default']:.3g}, "
              f"true on-policy {gaps['true on-policy']:.3g}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    known, extra = ap.parse_known_args()
    bench(known.steps, extra)
