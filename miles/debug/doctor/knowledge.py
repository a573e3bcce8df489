"""The knowledge base of real failures (kb/): culprits and cases, loaded and checked.

`python -m miles.debug.doctor.knowledge` checks every file and prints counts per culprit and framework.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

KB = Path(__file__).parent / "kb"
CASE_KEYS = ("id", "url", "framework", "title", "symptom", "report", "signature", "culprit", "culprit_detail",
             "fix", "evidence", "evidence_url")


@dataclass(frozen=True)
class Culprit:
    id: str
    name: str
    guide: str
    fix: str
    signals: str  # the words reports of this culprit use: its profile for the retrieval
    scope: str  # what it covers and where its border with its neighbours lies: the labelling rule

    @property
    def short_name(self) -> str:
        """The name without its parenthesised examples."""
        return self.name.split(" (")[0]


@dataclass(frozen=True)
class Case:
    id: str
    url: str
    framework: str
    title: str
    symptom: str
    report: str
    signature: tuple[str, ...]
    culprit: str | None
    culprit_detail: str
    fix: str
    evidence: str
    evidence_url: str

    @property
    def text(self) -> str:
        """What a user would have pasted: the report and its log lines."""
        return "\n".join([self.title, self.symptom, self.report, *self.signature])


class KBError(ValueError):
    pass


@lru_cache(maxsize=1)
def culprits() -> dict[str, Culprit]:
    data = json.loads((KB / "culprits.json").read_text())
    return {c["id"]: Culprit(c["id"], c["name"], c["guide"], c["fix"], c["signals"], c["scope"])
            for c in data["culprits"]}


def _read(path: Path, distractor: bool) -> list[Case]:
    known = culprits()
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path.relative_to(KB)}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise KBError(f"{where}: not JSON ({e.msg})") from None
        missing = [k for k in CASE_KEYS if k not in row]
        extra = sorted(set(row) - set(CASE_KEYS))
        if missing or extra:
            raise KBError(f"{where}: missing keys {missing}, unknown keys {extra}")
        if distractor != (row["culprit"] is None) or (row["culprit"] is not None and row["culprit"] not in known):
            raise KBError(f"{where}: culprit {row['culprit']!r} is not " +
                          ("null (a distractor)" if distractor else "an id of culprits.json"))
        if not isinstance(row["signature"], list) or not all(isinstance(s, str) for s in row["signature"]):
            raise KBError(f"{where}: signature must be a list of strings")
        if not str(row["url"]).startswith("https://"):
            raise KBError(f"{where}: url must be https://...")
        out.append(Case(**{**row, "signature": tuple(row["signature"])}))
    return out


@lru_cache(maxsize=1)
def cases() -> tuple[Case, ...]:
    out = [c for p in sorted((KB / "cases").glob("*.jsonl")) for c in _read(p, distractor=False)]
    _unique(out)
    return tuple(out)


@lru_cache(maxsize=1)
def distractors() -> tuple[Case, ...]:
    path = KB / "distractors.jsonl"
    out = _read(path, distractor=True) if path.exists() else []
    _unique(list(cases()) + out)
    return tuple(out)


@lru_cache(maxsize=1)
def pending_cases() -> tuple[Case, ...]:
    """Checked real cases kept out of the base the doctor matches against (kb/pending/*.jsonl, see kb/README.md):
    `python -m miles.debug.doctor.evaluate --with-pending` measures the base with them."""
    out = [c for p in sorted((KB / "pending").glob("*.jsonl")) for c in _read(p, distractor=False)]
    _unique([*cases(), *distractors(), *out])
    return tuple(out)


def _unique(rows: list[Case]) -> None:
    for key in ("id", "url"):
        dup = [v for v, n in Counter(getattr(c, key) for c in rows).items() if n > 1]
        if dup:
            raise KBError(f"duplicate {key}s in the knowledge base: {dup[:5]}")


def main() -> int:
    try:
        cs, ds, ps = cases(), distractors(), pending_cases()
    except KBError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(cs)} cases, {len(ds)} distractors, {len(ps)} pending cases (not in the base)")
    by_culprit = Counter(c.culprit for c in cs)
    for cid in culprits():
        print(f"  {cid:32s} {by_culprit.get(cid, 0)}")
    print("frameworks: " + ", ".join(f"{f} {n}" for f, n in Counter(c.framework for c in cs).most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
