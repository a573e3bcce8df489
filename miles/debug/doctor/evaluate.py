"""How often the doctor names the culprit its maintainers established, measured honestly.

    python -m miles.debug.doctor.evaluate [--clean-runs 3] [--fixtures tests/fixtures/doctor] [--json OUT] [--misses]
                                          [--with-pending]

- Leave-one-out over the knowledge base: each case's report (what its reporter pasted, `Case.text`)
  is written to a file and read by the doctor as a user's file would be, matched against the
  knowledge base without that case. Top-1: the first finding names the case's culprit; top-3: one
  of the first three culprits named. Printed per culprit and per framework.
- False alarms: the share of inputs for which the doctor names any culprit, on the distractors (real
  reports whose cause is none of the culprits; also held out one at a time) and on clean miles runs
  (the demo model trained here, `--clean-runs` of them, with different settings; the tiny random test
  models are no clean runs: their step-1 alignment check rightly warns about their response NLL).
- Planted faults (`--fixtures DIR`): the test suite's doctor fixtures, each with the culprit its
  `expected.json` says must come first (null: a clean run, where no culprit may be named).
- `--with-pending`: the same with kb/pending/ added to the base, as if those checked cases were in it
  (they are kept out while they cost more in false alarms than they give: kb/README.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from miles.debug.doctor.knowledge import Case, cases, culprits, distractors, pending_cases


@dataclass
class Outcome:
    case: Case
    named: list[str]  # culprit ids the doctor named, first finding first

    @property
    def top1(self) -> bool:
        return bool(self.named) and self.named[0] == self.case.culprit

    @property
    def top3(self) -> bool:
        return self.case.culprit in self.named[:3]


def named_culprits(findings) -> list[str]:
    """The culprit ids the findings name, in order; a knowledge-base finding's runners-up after it."""
    return list(dict.fromkeys(k for f in findings if f.kb and not f.fate for k in (f.kb, *f.also)))


def run_doctor(text: str, index, tmp: Path) -> list[str]:
    from miles.debug.doctor import diagnose
    from miles.debug.doctor.readers import collect

    path = tmp / "report.md"
    path.write_text(text)
    return named_culprits(diagnose(collect([str(path)]), index))


def leave_one_out(rows: tuple[Case, ...], base: list[Case], tmp: Path) -> list[Outcome]:
    """Each row matched against BASE without it (a case never sees itself)."""
    from miles.debug.doctor.retrieval import CaseIndex

    return [Outcome(c, run_doctor(c.text, CaseIndex([b for b in base if b.id != c.id]), tmp)) for c in rows]


def clean_runs(n: int, tmp: Path) -> list[Path]:
    """N finished demo-model `miles train` runs (SmolLM2-135M-Instruct, the embedded default recipe cut to
    2 steps), each with other settings; all healthy. About a minute each on 2 CPU cores."""
    variants = [[], ["--deterministic-mode"], ["--advantage-estimator", "reinforce_plus_plus"],
                ["--n-samples-per-prompt", "8", "--rollout-batch-size", "4"], ["--lr", "1e-5", "--kl-coef", "0.01"],
                ["--rollout-temperature", "0.7"]]
    out = []
    for k in range(n):
        run = tmp / f"clean-{k}"
        cmd = [sys.executable, "-m", "miles", "train", "--num-rollout", "2", "--seed", str(k), "--output-dir", str(run),
               *variants[k % len(variants)]]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"clean run {k} ({' '.join(cmd[3:])}) failed: {done.stderr.strip().splitlines()[-1:]}")
        out.append(run)
    return out


def planted_faults(directory: Path, index=None) -> list[tuple[str, str | None, list[str]]]:
    """(fixture, expected culprit, culprits named) for each fixture of DIR/expected.json, against INDEX (default:
    the whole knowledge base)."""
    from miles.debug.doctor import diagnose
    from miles.debug.doctor.readers import collect

    expected = json.loads((directory / "expected.json").read_text())
    return [(name, want, named_culprits(diagnose(collect([str(directory / name)]), index)))
            for name, want in expected.items() if not name.startswith("_")]


def table(title: str, groups: dict[str, list[Outcome]]) -> list[str]:
    lines = [f"{title:34}{'cases':>6}{'top-1':>8}{'top-3':>8}"]
    for name, outs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"{name:34}{len(outs):6d}{_pct(sum(o.top1 for o in outs), len(outs)):>8}"
                     f"{_pct(sum(o.top3 for o in outs), len(outs)):>8}")
    return lines


def _pct(k: int, n: int) -> str:
    return f"{100 * k / n:.0f}%" if n else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clean-runs", type=int, default=3, help="clean demo-model runs to train and read (default 3; "
                                                              "about a minute each)")
    ap.add_argument("--fixtures", metavar="DIR", type=Path, help="also score the planted faults of DIR/expected.json")
    ap.add_argument("--json", metavar="OUT", help="also write every outcome as JSON to OUT")
    ap.add_argument("--misses", action="store_true", help="list each case the doctor got wrong")
    ap.add_argument("--with-pending", action="store_true", help="add the pending cases (kb/pending/) to the base")
    args = ap.parse_args(argv)
    from miles.debug.doctor import diagnose
    from miles.debug.doctor.readers import collect
    from miles.debug.doctor.retrieval import CaseIndex

    known, noise = list(cases()) + (list(pending_cases()) if args.with_pending else []), list(distractors())
    base = known + noise
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        outcomes = leave_one_out(tuple(known), base, tmp)
        alarms = leave_one_out(tuple(noise), base, tmp)
        runs = clean_runs(args.clean_runs, tmp) if args.clean_runs else []
        full = CaseIndex(base)
        clean = [(r.name, named_culprits(diagnose(collect([str(r)]), full))) for r in runs]
        planted = planted_faults(args.fixtures, full if args.with_pending else None) if args.fixtures else []
    n = len(outcomes)
    top1, top3 = sum(o.top1 for o in outcomes), sum(o.top3 for o in outcomes)
    print(f"knowledge base: {n} cases over {len({c.culprit for c in known})} culprits, {len(noise)} distractors"
          f"{' (pending cases included)' if args.with_pending else ''}; each held out of the base "
          f"it is matched against")
    print(f"leave-one-out: top-1 {_pct(top1, n)} ({top1}/{n}), top-3 {_pct(top3, n)} ({top3}/{n})\n")
    by_culprit, by_framework = defaultdict(list), defaultdict(list)
    for o in outcomes:
        by_culprit[o.case.culprit].append(o)
        by_framework[o.case.framework].append(o)
    print("\n".join(table("per culprit", by_culprit)) + "\n")
    print("\n".join(table("per framework", by_framework)) + "\n")
    false_d = [o for o in alarms if o.named]
    false_c = [(name, named) for name, named in clean if named]
    print(f"false alarms on distractors: {_pct(len(false_d), len(alarms))} ({len(false_d)}/{len(alarms)})")
    print(f"false alarms on clean runs: {_pct(len(false_c), len(clean))} ({len(false_c)}/{len(clean)})")
    if planted:
        right = [p for p in planted if (p[2][:1] == [p[1]] if p[1] else not p[2])]
        print(f"planted faults of {args.fixtures}: {_pct(len(right), len(planted))} ({len(right)}/{len(planted)}) "
              "named first (clean ones: nothing named)")
    if args.misses:
        names = culprits()
        for name, want, named in planted:
            if (named[:1] != [want]) if want else named:
                print(f"  planted {name}: {want} -> {named[:3] or 'nothing'}")
        for o in outcomes:
            if not o.top1:
                print(f"  miss {o.case.id}: {o.case.culprit} -> {o.named[:3] or 'nothing'}")
        for o in false_d:
            print(f"  alarm {o.case.id}: {o.named[:3]}")
        for name, named in false_c:
            print(f"  alarm {name}: {named} ({', '.join(names[c].name[:40] for c in named)})")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "cases": [{"id": o.case.id, "culprit": o.case.culprit, "named": o.named} for o in outcomes],
            "distractors": [{"id": o.case.id, "named": o.named} for o in alarms],
            "clean_runs": [{"run": name, "named": named} for name, named in clean],
            "planted": [{"fixture": f, "expected": w, "named": n} for f, w, n in planted]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
