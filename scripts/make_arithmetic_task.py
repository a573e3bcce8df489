"""Write the bundled demo task miles/data/tasks/arithmetic.jsonl and its held-out evaluation set
arithmetic_eval.jsonl (deterministic).

241 addition problems: all 81 single-digit pairs a + b (a, b in 1..9) plus 160 distinct
pairs of a two-digit (10..99) and a single-digit (1..9) operand, all shuffled together. The
evaluation set: 32 more two-digit + one-digit problems, none of them (in either order) in the
training file. The fixed seeds make both files reproducible: rerunning this script must not
change them.

    python scripts/make_arithmetic_task.py [--out PATH] [--eval-out PATH]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 1234
N_HARD = 160
N_EVAL = 32
TASKS = Path(__file__).resolve().parent.parent / "miles" / "data" / "tasks"
DEFAULT_OUT = TASKS / "arithmetic.jsonl"
DEFAULT_EVAL_OUT = TASKS / "arithmetic_eval.jsonl"


def make_rows(seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    # Hard pairs: no duplicates, and a + b never appears alongside b + a either, so the
    # 160 are 160 genuinely different problems.
    seen: set[tuple[int, int]] = set()
    hard = []
    while len(hard) < N_HARD:
        a, b = rng.randint(10, 99), rng.randint(1, 9)
        if rng.random() < 0.5:
            a, b = b, a  # the big operand comes first or second
        key = (min(a, b), max(a, b))
        if key in seen:
            continue
        seen.add(key)
        hard.append((a, b))
    pairs += hard
    rng.shuffle(pairs)
    return [{"prompt": f"What is {a} + {b}? Answer with just the number.", "label": str(a + b)} for a, b in pairs]


def make_eval_rows(train: list[dict], seed: int = SEED + 1) -> list[dict]:
    """N_EVAL two-digit + one-digit problems whose operands (in either order) no training row has."""
    import re

    rng = random.Random(seed)
    taken = {tuple(sorted(map(int, re.findall(r"\d+", r["prompt"])[:2]))) for r in train}
    rows = []
    while len(rows) < N_EVAL:
        a, b = rng.randint(10, 99), rng.randint(1, 9)
        if rng.random() < 0.5:
            a, b = b, a
        key = (min(a, b), max(a, b))
        if key in taken:
            continue
        taken.add(key)
        rows.append({"prompt": f"What is {a} + {b}? Answer with just the number.", "label": str(a + b)})
    return rows


def write(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(rows)} rows to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--eval-out", type=Path, default=DEFAULT_EVAL_OUT)
    args = ap.parse_args()
    rows = make_rows()
    write(rows, args.out)
    write(make_eval_rows(rows), args.eval_out)


if __name__ == "__main__":
    main()
