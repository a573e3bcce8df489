"""Write the bundled demo task miles/data/tasks/arithmetic.jsonl (deterministic).

241 addition problems: all 81 single-digit pairs a + b (a, b in 1..9) plus 160 distinct
pairs of a two-digit (10..99) and a single-digit (1..9) operand, all shuffled together. The fixed
seed makes the file reproducible: rerunning this script must not change it.

    python scripts/make_arithmetic_task.py [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 1234
N_HARD = 160
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "miles" / "data" / "tasks" / "arithmetic.jsonl"


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    rows = make_rows()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
