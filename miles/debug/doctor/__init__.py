"""`miles doctor PATH...`: reads run dirs and logs, names the symptom, quotes the evidence, gives the fix.

    miles doctor runs/2025-06-01_120000                # a miles run dir
    miles doctor train.log /tmp/sglang ~/.ray/session_latest/logs   # any logs: miles, Miles, slime, verl, TRL
    miles doctor RUN --json                            # for machines
    miles doctor RUN --bundle bug.md                   # everything a bug report needs, secrets redacted
    miles doctor issue.md pip-freeze.txt               # a user's report as pasted from GitHub, a pip freeze

Layout: `readers` turns the paths into a Corpus (log lines, metric series, configs, rollout dumps),
opening only regular files (`files`); `run_state` says how each miles run ended (finished, crashed,
stopped, killed, still running); `rules`, `crashes` and `signals` hold the knowledge, one rule per
symptom of the debugging guide; `findings` merges and ranks; `facts` reads framework, versions, flags,
MoE/FP8, errors and metrics from any text; `retrieval` matches the input against the knowledge base of
real failures (`knowledge`, kb/) for a culprit no rule named and the known cases seen before;
`bundle` writes the bug-report file.
Nothing here imports torch, except reading rollout dumps and the bundle's version probe.
"""

from __future__ import annotations

import argparse
import json

EPILOG = """\
exit status: 0 no finding; 1 findings were reported (so `miles doctor RUN || ...` flags a sick run);
2 bad usage or a PATH that does not exist / holds nothing readable (one `error:` line).
How a run ended comes first (crashed, stopped with an error, by a signal or on non-finite values, or killed:
no `Done:` line and no live lock); a run still in progress is no finding. The rest are ranked by
confidence: high (>= 0.75), medium (>= 0.5), low."""


def register(commands) -> None:
    p = commands.add_parser("doctor", help="read run dirs / log files; print findings: symptom, evidence, likely "
                                           "culprit, fix", description=__doc__.split("\n\n")[0],
                            epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", metavar="PATH", help="miles run dirs, log files or log folders (Ray session "
                                                            "dirs, SGLang logs, NCCL debug files, stdout captures)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--bundle", metavar="OUT", help="also write a bug-report file (Markdown) to OUT: launch command, "
                                                   "config, pip freeze, versions, log head, findings, last metrics")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from miles.debug.doctor.bundle import redact, write_bundle
    from miles.debug.doctor.readers import collect
    from miles.debug.doctor.run_state import run_states
    from miles.debug.doctor.signals import signals
    from miles.errors import UsageError

    corpus = collect(args.paths)
    findings, facts, closest = diagnose_full(corpus)
    for f in findings:  # evidence (and culprits naming an error line) quote logs; logs hold tokens
        f.symptom, f.culprit, f.fix = redact(f.symptom), redact(f.culprit), redact(f.fix)  # fix: resume commands
        for e in f.evidence:
            e.text = redact(e.text)
    sigs = signals(corpus)
    runs = run_states(corpus)
    for r in runs:
        r.detail = redact(r.detail)
    text = render(corpus, findings, sigs, runs, facts, closest)
    bundle = None
    if args.bundle:
        try:
            bundle = write_bundle(args.bundle, corpus, args.paths, text)
        except OSError as e:
            raise UsageError(f"--bundle {args.bundle}: cannot write there ({e.strerror or e})") from None
    if args.json:
        print(json.dumps({"paths": args.paths, "findings": [f.to_dict() for f in findings],
                          "signal_phrases": [s.to_dict() for s in sigs], "runs": [r.to_dict() for r in runs],
                          "facts": facts.to_dict(), "closest_known": closest.to_dict() if closest else None,
                          "read": corpus.read_list(),
                          "skipped": [{"path": p, "why": w} for p, w in corpus.skipped],
                          "bundle": str(bundle) if bundle else None}, indent=2))
    else:
        print(text, end="")
        if bundle:
            print(f"\nBundle written to {bundle}")
    return 1 if findings else 0


def diagnose(corpus, index=None) -> list:
    """Every rule's findings, merged per symptom and ranked, with the knowledge base's known cases
    (retrieval.py); an unknown error when nothing matched."""
    return diagnose_full(corpus, index)[0]


def diagnose_full(corpus, index=None) -> tuple:
    """(findings, the facts read from the input, the closest known failures when nothing was found but the input
    says something is wrong: retrieval.Closest or None)."""
    from miles.debug.doctor import crashes, run_state, signals  # noqa: F401  (importing registers their rules)
    from miles.debug.doctor.findings import merge_and_rank
    from miles.debug.doctor.retrieval import consult
    from miles.debug.doctor.rules import RULES

    findings, facts, closest = consult(corpus, merge_and_rank([f for rule in RULES for f in rule(corpus)]), index)
    return findings or crashes.unrecognised_error(corpus), facts, closest


def render(corpus, findings: list, sigs: list, runs: list = (), facts=None, closest=None) -> str:
    read = corpus.read_list()
    out = []
    if findings:
        out.append(f"miles doctor: {len(findings)} finding(s) from {len(read)} file(s), most likely first\n")
        for n, f in enumerate(findings, 1):
            out.append(f"{n}. {f.symptom}  [confidence {f.level}, {f.confidence:.2f}]")
            for k, e in enumerate(f.evidence):
                out.append(f"   {'evidence:' if k == 0 else '         '} {e.where}: {e.text}")
            out.append(f"   likely culprit: {f.culprit}")
            out.append(f"   fix: {f.fix}")
            for k, case in enumerate(f.seen):
                out.append(f"   {'seen before in:' if k == 0 else '               '} {case['url']} "
                           f"({case['framework']}: {case['title']})")
            out.append("")
    else:
        out.append("miles doctor: no known symptom found in what was read.\n")
    if facts is not None and (not findings or all(f.id == "unrecognised_error" for f in findings)):
        known = facts.summary()
        out.append("What the doctor could read: " + ("; ".join(known) if known else "no framework, version, flag, "
                                                                                    "error or metric"))
        if facts.missing() and not any(log.kind == "miles-train" for log in corpus.logs):  # a run dir holds it all
            out.append("Missing, to name a culprit: " + "; ".join(facts.missing()))
        out.append("")
    if closest is not None:  # only made when nothing but an unrecognised error was found
        from miles.debug.doctor.knowledge import culprits

        out.append(f"Closest known failures, not close enough to name a culprit (nearest kind: "
                   f"{culprits()[closest.culprit].short_name}):")
        out.extend(f"  {c['url']} ({c['framework']}: {c['title']})" for c in closest.cases)
        out.append("")
    found = [f"`{s.phrase}` ({s.count}x)" for s in sigs if s.count]
    out.append("Signal phrases: found " + (", ".join(found) if found else "none"))
    for s in sigs:
        if not s.count and s.expected:
            out.append(f"  missing `{s.phrase}` (expected here): {s.missing_means}")
    absent = [f"`{s.phrase}` ({s.absent_note})" for s in sigs if not s.count and not s.expected]
    if absent:
        out.append("  absent, as expected: " + ", ".join(absent))
    if runs:
        out.append("\nRuns (how each miles run dir ended):" + "".join(f"\n  {r.dir}: {r.detail}" for r in runs))
    shown = read if not findings else read[:8]
    out.append(f"\nRead {len(read)} file(s):" + "".join(f"\n  {r}" for r in shown)
               + (f"\n  ... and {len(read) - len(shown)} more" if len(read) > len(shown) else ""))
    if corpus.skipped:
        out.append(f"Skipped {len(corpus.skipped)}: " + "; ".join(f"{p} ({w})" for p, w in corpus.skipped[:5])
                   + (" ..." if len(corpus.skipped) > 5 else ""))
    return "\n".join(out) + "\n"
