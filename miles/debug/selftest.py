"""`miles selftest`: does this install reproduce a known-good recipe?

The guide's advice when all else fails is to drop to a tiny model on a known-good recipe, to
tell framework bugs from model bugs. This runs such a recipe (a tiny random Llama built in code,
3 deterministic steps) and compares its per-step metrics and hashes with the values shipped in
`miles/testing/selftest_expected.json`: bitwise where the platform allows (same CPU kind, torch
and BLAS), within a stated tolerance otherwise, and names the first step and component that
departs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from miles.debug.diff_runs import COMPONENTS, WHAT_IT_MEANS

EXPECTED = Path(__file__).resolve().parent.parent / "testing" / "selftest_expected.json"
METRICS = ("rollout/reward_mean", "rollout/response_len_mean", "rollout/log_probs", "train/loss",
           "train/grad_norm", "train/entropy", "forward_logp_max_diff")
RTOL, ATOL = 1e-4, 1e-6


def register(commands) -> None:
    p = commands.add_parser("selftest", help="run a known-good tiny recipe and compare it with shipped values",
                            description=__doc__.splitlines()[0])
    p.add_argument("--expected", default=str(EXPECTED), metavar="JSON", help="reference values (default: shipped)")
    p.add_argument("--write-expected", metavar="JSON", help="record this install's values as a new reference")
    p.set_defaults(run=run)


def run_recipe(workdir: Path) -> dict:
    """Runs the recipe in a subprocess (one thread: CPU reductions depend on the thread count)."""
    from miles.testing.tiny import build_model_dir, train_args, write_prompts

    model = build_model_dir(workdir / "model", "llama", seed=0)
    argv = train_args(model, write_prompts(workdir / "prompts.jsonl"), workdir / "run") + [
        "--num-rollout", "3", "--deterministic-mode", "--debug-determinism", "--alignment-check", "off"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "miles", *argv], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"error: the selftest recipe itself failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    read = lambda name: [json.loads(line) for line in (workdir / "run" / name).read_text().splitlines()]  # noqa: E731
    return {"metrics": [{k: row[k] for k in METRICS} for row in read("metrics.jsonl")],
            "hashes": [{k: row[k] for k in COMPONENTS} for row in read("hashes.jsonl")]}


def platform_info() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "machine": platform.machine(),
            "python": platform.python_version()}


def compare(got: dict, expected: dict) -> tuple[str | None, str | None]:
    """Returns (first hash departure, first metric departure beyond tolerance), None when none."""
    hash_departure = metric_departure = None
    for step, (g, e) in enumerate(zip(got["hashes"], expected["hashes"]), 1):
        bad = next((c for c in COMPONENTS if g[c] != e[c]), None)
        if bad:
            hash_departure = f"step {step}, {bad}: {WHAT_IT_MEANS[bad]}"
            break
    for step, (g, e) in enumerate(zip(got["metrics"], expected["metrics"]), 1):
        bad = next((k for k in METRICS if abs(g[k] - e[k]) > ATOL + RTOL * abs(e[k])), None)
        if bad:
            metric_departure = f"step {step}, {bad}: expected {e[bad]:.8g}, got {g[bad]:.8g}"
            break
    return hash_departure, metric_departure


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        got = run_recipe(Path(tmp))
    if args.write_expected:
        from miles.utils.io import atomic_write_json

        atomic_write_json(args.write_expected, {"platform": platform_info(), **got})
        print(f"wrote the reference values of this install to {args.write_expected}")
        return 0
    expected = json.loads(Path(args.expected).read_text())
    here, there = platform_info(), expected["platform"]
    print(f"reference made on: {', '.join(f'{k} {there.get(k)}' for k in here)}")
    print(f"this install:      {', '.join(f'{k} {v}' for k, v in here.items())}")
    hash_departure, metric_departure = compare(got, expected)
    steps = len(expected["hashes"])
    if hash_departure is None:
        print(f"Selftest: PASS, bitwise identical to the reference for {steps} steps")
        return 0
    print(f"hashes: first departure at {hash_departure}")
    if metric_departure is None:
        print(f"Selftest: PASS within tolerance (rtol {RTOL}, atol {ATOL}) on {', '.join(METRICS)}; not bitwise, "
              f"which is expected across CPU kinds, torch or BLAS builds")
        return 0
    print(f"Selftest: FAIL, first departs at {metric_departure}")
    return 3
