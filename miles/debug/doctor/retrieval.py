"""Matching what was pasted against the knowledge base of real failures (kb/), by BM25 (the bm25s library).

Every known case (and every distractor: a real report whose cause is none of the culprits) is a
document: its title, symptom, report and signature lines. The input is the query: its error and prose
lines plus the facts read from it (`facts.py`). The closest cases vote for their culprit, each with its
BM25 score; distractors vote for "none of these". The winner becomes a finding when it holds enough of
the vote and the match is close enough (both thresholds below, set on the leave-one-out evaluation of
benchmarks/doctor_eval.py). The finding quotes the input lines that share the most rare words with the
winning cases, and lists those cases with their URLs ("seen before in ...").
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from bm25s.stopwords import STOPWORDS_EN

from miles.debug.doctor.findings import Evidence, Finding
from miles.debug.doctor.knowledge import Case, culprits
from miles.debug.doctor.readers import flatten

NEIGHBOURS = 7  # cases that vote
MIN_SHARE = 0.40  # of the neighbours' score the winning culprit must hold
MIN_MATCH = 0.20  # the best case's score per distinct query word: below it the input is unlike every case
MAX_QUERY_LINES = 600
_WORD = re.compile(r"(?u)\b\w\w+\b")
# Words every report holds (English stop words, and the words of any bug report): they say nothing of the cause.
_STOP = frozenset(STOPWORDS_EN) | {"this", "that", "with", "from", "was", "were", "have", "has", "had", "when", "then",
                                   "after", "before", "which", "what", "there", "also", "just", "only", "can", "could",
                                   "would", "should", "use", "used", "using", "run", "running", "get", "got", "see",
                                   "step", "steps", "error", "issue", "bug", "version", "python", "none", "true",
                                   "false"}


def tokens(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in _STOP and not w.isdigit()]


@dataclass
class Vote:
    culprit: str | None  # None: the distractors (none of the culprits)
    share: float
    cases: list[tuple[Case, float]]  # the neighbours that voted for it, closest first


@dataclass
class Match:
    votes: list[Vote]  # most voted first
    match: float  # the best case's score per distinct query word
    query_words: int

    @property
    def top(self) -> Vote | None:
        return self.votes[0] if self.votes else None

    def ranked_culprits(self) -> list[str]:
        return [v.culprit for v in self.votes if v.culprit]

    @property
    def confident(self) -> bool:
        t = self.top
        return bool(t and t.culprit and t.share >= MIN_SHARE and self.match >= MIN_MATCH)


class CaseIndex:
    """BM25 over the cases' texts; `match(text)` ranks culprits by the votes of the closest cases."""

    def __init__(self, cases: Sequence[Case]):
        import bm25s

        self.cases = list(cases)
        docs = [tokens(c.text) for c in self.cases]
        self.bm25 = bm25s.BM25()
        if docs:
            self.bm25.index(docs, show_progress=False)
        df = Counter(w for d in docs for w in set(d))
        self.idf = {w: math.log(1 + len(docs) / n) for w, n in df.items()}
        self.doc_words = [set(d) for d in docs]

    def match(self, text: str) -> Match:
        words = tokens(text)
        known = [w for w in words if w in self.idf]
        if not known:
            return Match([], 0.0, 0)
        scores = self.bm25.get_scores(known)
        order = sorted(range(len(self.cases)), key=lambda i: -scores[i])[:NEIGHBOURS]
        near = [(self.cases[i], float(scores[i])) for i in order if scores[i] > 0]
        total = sum(s for _, s in near) or 1.0
        by: dict[str | None, list[tuple[Case, float]]] = {}
        for case, s in near:
            by.setdefault(case.culprit, []).append((case, s))
        votes = sorted((Vote(k, sum(s for _, s in v) / total, v) for k, v in by.items()), key=lambda v: -v.share)
        best = near[0][1] if near else 0.0
        return Match(votes, best / len(set(known)), len(set(known)))

    def evidence_lines(self, lines: list[tuple[str, str]], vote: Vote, n: int = 3) -> list[Evidence]:
        """The input lines (where, text) sharing the most rare words with the cases that voted."""
        words = set().union(*(self.doc_words[self.cases.index(c)] for c, _ in vote.cases))
        scored = []
        for where, text in lines:
            shared = set(tokens(text)) & words
            score = sum(self.idf.get(w, 0.0) for w in shared)
            if score > 0:
                scored.append((score, where, text))
        scored.sort(key=lambda t: -t[0])
        return [Evidence(where, text.strip()[:300]) for _, where, text in scored[:n]]


def query_lines(corpus) -> list[tuple[str, str]]:
    """(where, text) of the lines worth matching: error lines first, then prose and config, capped."""
    errors, rest = [], []
    for log in corpus.logs:
        for i, line in enumerate(log.lines):
            s = line.strip()
            if len(s) < 4 or s.startswith("```"):
                continue
            target = errors if re.search(r"(?i)error|exception|fail|nan\b|timeout|hang|illegal|killed", s) else rest
            target.append((log.where(i), s))
    for path, cfg in corpus.configs:
        rest.extend((str(path), f"{k}={v}") for k, v in flatten(cfg) if v not in (False, None, "", []))  # set ones
    return (errors + rest)[:MAX_QUERY_LINES]



def seen_before(vote: Vote, limit: int = 3) -> list[dict]:
    return [{"url": c.url, "framework": c.framework, "title": c.title, "culprit": c.culprit_detail,
             "score": round(s, 2)} for c, s in vote.cases[:limit]]


def finding_from(index: CaseIndex, m: Match, lines: list[tuple[str, str]]) -> Finding:
    """The retrieval's finding: the culprit the closest known cases share, with their fixes and URLs."""
    vote = m.top
    known = culprits()[vote.culprit]
    closest = vote.cases[0][0]
    confidence = round(min(0.7, 0.3 + 0.4 * vote.share * min(1.0, m.match / (2 * MIN_MATCH))), 2)
    return Finding(f"kb_{vote.culprit}", f"like {len(vote.cases)} known failure report(s): {known.name}", confidence,
                   index.evidence_lines(lines, vote), f"{known.name}; in the closest case ({closest.framework}): "
                   f"{closest.culprit_detail}", f"{known.fix}; what fixed the closest case: {closest.fix}",
                   kb=vote.culprit, seen=seen_before(vote))


_INDEX: CaseIndex | None = None


def default_index() -> CaseIndex:
    """The whole knowledge base: every case and every distractor (built once per process)."""
    global _INDEX
    if _INDEX is None:
        from miles.debug.doctor.knowledge import cases, distractors

        _INDEX = CaseIndex([*cases(), *distractors()])
    return _INDEX


def consult(corpus, findings: list[Finding], index: CaseIndex | None = None) -> tuple[list[Finding], Match, object]:
    """The rules' findings with the knowledge base's word on them: known cases of the culprit a rule named
    ("seen before in"), and a finding of its own when the closest cases agree on a culprit no rule named.
    Returns (findings ranked, the match, the facts read)."""
    from miles.debug.doctor.facts import read_facts

    index = index or default_index()
    lines = query_lines(corpus)
    facts = read_facts("\n".join(t for _, t in lines))
    m = index.match("\n".join(t for _, t in lines) + "\n" + " ".join(facts.terms()))
    votes = {v.culprit: v for v in m.votes if v.culprit}
    for f in findings:
        if f.kb in votes and not f.seen:
            f.seen = seen_before(votes[f.kb])
    if m.confident and m.top.culprit not in {f.kb for f in findings}:
        findings = sorted([*findings, finding_from(index, m, lines)], key=lambda f: (not f.fate, -f.confidence))
    return findings, m, facts
