"""`miles diff-runs RUN_A RUN_B`: where two runs first part, from their `hashes.jsonl`.

Components are compared in data-flow order (prompts -> tokens -> engine log-probs -> rewards ->
trainer log-probs -> loss -> gradients -> parameters), so the first difference is the cause and
everything after it is consequence. Exit 0 when identical, 1 when not: usable as a
`git bisect run` predicate against a known-good run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from miles.errors import UsageError

COMPONENTS = ("prompts", "rollout_tokens", "rollout_log_probs", "rollout_routes", "rewards", "trainer_log_probs",
              "loss", "gradients", "parameters")  # data-flow order; rollout_routes only in MoE runs with routes

WHAT_IT_MEANS = {
    "prompts": "the runs drew different prompts (data, --rollout-shuffle, --seed, or a resumed data position)",
    "rollout_tokens": "the engine sampled different tokens: sampling seed, engine weights or engine numerics",
    "rollout_log_probs": "same tokens, different engine log-probs: engine numerics (kernels, precision, batch shape)",
    "rollout_routes": "same tokens, different MoE expert choices in the engine: engine numerics or its router "
                      "weights (replayed with --use-rollout-routing-replay, they change what the trainer computes)",
    "rewards": "same responses, different rewards: the reward function or the labels",
    "trainer_log_probs": "same rollout, different trainer log-probs: trainer weights or forward numerics",
    "loss": "same log-probs, different loss: loss flags (--eps-clip, --kl-*, --advantage-estimator) or their code",
    "gradients": "same loss, different gradients: backward numerics (non-deterministic kernels) or batch split",
    "parameters": "same gradients, different parameters: the optimizer (--lr, --weight-decay, --clip-grad) "
                  "or its state",
}


def register(commands) -> None:
    p = commands.add_parser("diff-runs", help="first step and component where two runs' hashes.jsonl diverge",
                            description=__doc__.splitlines()[0])
    p.add_argument("run_a", metavar="RUN_A", help="run dir (or its hashes.jsonl), made with --debug-determinism")
    p.add_argument("run_b", metavar="RUN_B")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def read_hashes(arg: str) -> list[dict]:
    path = Path(arg)
    if path.is_dir():
        path = path / "hashes.jsonl"
    if not path.is_file():
        raise UsageError(f"{arg}: no hashes.jsonl (run `miles train` with --debug-determinism)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UsageError(f"{path} line {n}: invalid JSON ({e.msg})") from None
    return rows


def compare(a: list[dict], b: list[dict]) -> dict:
    by_step_b = {r["step"]: r for r in b}
    common = [r for r in a if r["step"] in by_step_b]
    for row_a in common:
        row_b = by_step_b[row_a["step"]]
        for component in COMPONENTS:
            if component in row_a and component in row_b and row_a[component] != row_b[component]:
                return {"identical": False, "step": row_a["step"], "component": component,
                        "a": row_a[component], "b": row_b[component], "means": WHAT_IT_MEANS[component],
                        "steps_compared": len(common)}
    return {"identical": True, "steps_compared": len(common), "steps_a": len(a), "steps_b": len(b)}


def run(args: argparse.Namespace) -> int:
    result = compare(read_hashes(args.run_a), read_hashes(args.run_b))
    if args.json:
        print(json.dumps(result, indent=2))
    elif result["identical"]:
        extra = "" if result["steps_a"] == result["steps_b"] else \
            f" (A has {result['steps_a']} steps, B {result['steps_b']}; only common steps compared)"
        print(f"identical for {result['steps_compared']} steps{extra}")
    else:
        print(f"first divergence: step {result['step']}, {result['component']} "
              f"(A {result['a']}, B {result['b']})\n  {result['means']}")
    return 0 if result["identical"] else 1
