"""Matching what was pasted against the knowledge base of real failures (kb/).

Two well-kept libraries, each for what it does well:

- Which culprit: a linear classifier (scikit-learn's LinearSVC over TF-IDF words, each camelCase or
  snake_case identifier also split into its parts: see `words`, and 2-4 character n-grams) trained on every
  known case (its report and, as a second document, the cause its maintainers established, both labelled with
  its culprit), every distractor (class "none": a real report whose cause is none of the
  culprits) and each culprit's profile (culprits.json `signals`, the words its reports use, given five
  times the weight of a case). The input is the query: its error, prose and config lines plus the
  facts read from it (`facts.py`).
- Whether any: a second LinearSVC (words and 3-5 character n-grams, classes balanced) trained on the
  cases (and the culprit profiles) against the distractors, each case and distractor read as the query it
  gives when pasted (`as_pasted`). The knowledge base names a culprit only when its score clears
  RELEVANCE_THRESHOLD; otherwise it names nothing.
- Seen before in: BM25 (bm25s) over the same documents ranks the known cases of that culprit closest
  to the input; the finding lists them with their URLs and quotes the input lines that share the most
  rare words with them.

The leave-one-out evaluation (`python -m miles.debug.doctor.evaluate`) measures it: each case and
distractor is held out of the training set and of the index it is matched against.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from bm25s.stopwords import STOPWORDS_EN

from miles.debug.doctor.findings import Evidence, Finding
from miles.debug.doctor.knowledge import Case, culprits
from miles.debug.doctor.readers import flatten

NONE = "none"  # the distractors' class
PROFILE_REPEATS = 5  # a culprit's profile counts as this many cases
SVM_C = 0.5  # with PROFILE_REPEATS, picked on the leave-one-out evaluation itself (C 0.2-1, repeats 2-5)
# Whether the input is a known failure at all: the case-vs-distractor classifier's score, named when it is
# > RELEVANCE_THRESHOLD. That classifier reads every document as the query it gives when pasted (`as_pasted`:
# lines reordered, facts added), as it reads the input, and counts each culprit profile as one more known failure.
# On the leave-one-out evaluation (349 cases, 126 distractors, 26 of them near misses; detector C 1) thresholds
# 0.3 / 0.35 / 0.4 / 0.45 / 0.5 give top-1 66.8 / 65.3 / 63.9 / 61.3 / 58.2% at false alarms on distractors
# 9.5 / 6.3 / 4.8 / 4.0 / 4.0% (12 / 8 / 6 / 5 / 5); adding 0.1 or 0.2 x the top culprit's lead over "none" to the
# score (the previous design's 0.2) gives 7 or 8 alarms at 0.4. Threshold and weight 0 picked on that evaluation
# itself. The previous design (the detector trained on the documents as written, without the profiles, margin
# weight 0.2) gives 63.6% top-1 at 6.3% (8) there. A nested estimate (5 folds stratified by culprit, 20 shuffles;
# margin weight 0-1 and threshold chosen on the other 4 folds' own 5-fold scores for <= 5% alarms there) gives
# 59.3% top-1 (top-3 65.6%) at 5.3% alarms for this design, 59.2% (65.4%) at 5.7% for the previous one: fewer
# alarms at the same top-1, a small gain (alarms fewer in 9 of the 20 shuffles, more in 4; lower than leave-one-out
# as each model sees 4/5 of the base).
# The culprit classifier's features: the TF-IDF of `words` beside that of the 2-4 character n-grams within words
# (char_wb, hashed) in 2 documents or more, which match an error's fragments and inflections the words miss. Ten-fold
# cross-validation over the base (3 shuffles), culprit ranked first before the relevance check: 74.6% with the words
# alone, 77.1% with the n-grams ((3, 5): 76.3%, (1, 3): 77.0%).
CHAR_GRAMS = (2, 4)
RELEVANCE_C = 1.0
RELEVANCE_THRESHOLD = 0.4
_HASH_FEATURES = 2 ** 20
SEEN = 3  # known cases listed per finding
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


# A code identifier: camelCase, an acronym before a word (GRPOTrainer), or snake_case.
_IDENTIFIER = re.compile(r"\b\w*(?:[a-z][A-Z]|[A-Z][A-Z][a-z]|[A-Za-z0-9]_[A-Za-z0-9])\w*\b")
_IDENTIFIER_PART = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+")


def words(text: str) -> list[str]:
    """The classifier's words: `tokens`, then the parts of each identifier (`num_iterations` adds `num` and
    `iterations`, `GRPOTrainer` adds `grpo` and `trainer`), so an error's symbol shares words with prose.
    Leave-one-out, culprit ranked first before the relevance check: 76.2% against 75.4% with `tokens` alone."""
    parts = [p.lower() for ident in _IDENTIFIER.findall(text) for p in _IDENTIFIER_PART.findall(ident)]
    return tokens(text) + [p for p in parts if len(p) > 1 and p not in _STOP]


# Hashed n-gram counts, each a tuple of (analyzer, n-gram range) blocks of _HASH_FEATURES columns side by side: the
# known-failure detector's words and 3-5 character n-grams, the culprit classifier's CHAR_GRAMS character n-grams.
DETECTOR_GRAMS = ((tokens, (1, 1)), ("char_wb", (3, 5)))
CLASSIFIER_GRAMS = (("char_wb", CHAR_GRAMS),)


@functools.cache
def _hasher(analyzer, ngram_range: tuple[int, int]):
    from sklearn.feature_extraction.text import HashingVectorizer

    return HashingVectorizer(n_features=_HASH_FEATURES, alternate_sign=False, norm=None, analyzer=analyzer,
                             ngram_range=ngram_range)


@functools.lru_cache(maxsize=8192)
def _counts(text: str, grams: tuple):
    """TEXT's hashed counts of GRAMS (cached: the leave-one-out evaluation builds an index per case over the same
    documents)."""
    from scipy.sparse import hstack

    return hstack([_hasher(a, r).transform([text]) for a, r in grams]).tocsr()


def hashed_counts(texts: Sequence[str], grams: tuple):
    from scipy.sparse import vstack

    return vstack([_counts(t, grams) for t in texts]).tocsr()


class FrequentTfidf:
    """Sublinear TF-IDF over the hashed columns that enough documents hold: MIN_DF[i] documents or more for the
    columns of block i (hash collisions aside, a gram seen once says nothing of a class)."""

    def __init__(self, min_df: Sequence[int]):
        self.min_df = list(min_df)
        self.parts: list = []  # (columns, TfidfTransformer) per block

    def fit(self, counts) -> "FrequentTfidf":
        from sklearn.feature_extraction.text import TfidfTransformer

        df = np.asarray((counts > 0).sum(0)).ravel()
        self.parts = []
        for b, k in enumerate(self.min_df):
            cols = b * _HASH_FEATURES + np.flatnonzero(df[b * _HASH_FEATURES:(b + 1) * _HASH_FEATURES] >= k)
            self.parts.append((cols, TfidfTransformer(sublinear_tf=True).fit(counts[:, cols])))
        return self

    def transform(self, counts):
        from scipy.sparse import hstack

        return hstack([tfidf.transform(counts[:, cols]) for cols, tfidf in self.parts]).tocsr()


@dataclass
class Match:
    ranked: list[tuple[str | None, float]]  # (culprit, classifier score), best first; None: "none of these"
    closest: dict[str, list[tuple[Case, float]]]  # culprit -> its known cases by BM25 score, closest first
    relevance: float = 0.0  # > 0: the input looks like a known failure (RELEVANCE_THRESHOLD cleared)

    @property
    def top(self) -> str | None:
        """The best-scored culprit, when the input is relevant; else None."""
        return next((k for k, _ in self.ranked if k), None) if self.relevance > 0 else None

    def ranked_culprits(self) -> list[str]:
        return [k for k, _ in self.ranked if k]

    @property
    def margin(self) -> float:
        """The top culprit's lead over the next culprit: the classifier's confidence."""
        scores = [v for k, v in self.ranked if k]
        return scores[0] - scores[1] if len(scores) > 1 else 1.0


class CaseIndex:
    """The classifier, the known-failure detector and the BM25 index over the cases, distractors and culprit
    profiles."""

    def __init__(self, cases: Sequence[Case], profiles: bool = True):
        import bm25s
        from scipy.sparse import hstack
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.svm import LinearSVC

        self.cases = list(cases)
        self.profiles = [(k, f"{c.name}; {c.signals}") for k, c in culprits().items()] if profiles else []
        docs = [tokens(c.text) for c in self.cases]
        self.bm25 = bm25s.BM25()
        if docs:
            self.bm25.index(docs, show_progress=False)
        df = Counter(w for d in docs for w in set(d))
        self.idf = {w: math.log(1 + len(docs) / n) for w, n in df.items()}
        self.doc_words = {c.id: set(d) for c, d in zip(self.cases, docs)}
        # Each known case twice: its report, and its cause in its maintainers' words (culprit_detail), which
        # names the mechanism that other reports of the culprit describe by its symptoms.
        known = [c for c in self.cases if c.culprit]
        texts = [c.text for c in self.cases] + [c.culprit_detail for c in known] + \
            [t for _, t in self.profiles] * PROFILE_REPEATS
        labels = [c.culprit or NONE for c in self.cases] + [c.culprit for c in known] + \
            [k for k, _ in self.profiles] * PROFILE_REPEATS
        self.vectorizer = TfidfVectorizer(analyzer=words, sublinear_tf=True)
        # random_state: liblinear's dual solver visits the documents in a random order; seeded, the same base gives
        # the same weights in every process (unseeded they differed by ~1e-5, enough to move a finding at its bar).
        self.classifier = None
        if len(set(labels)) > 1:
            chars = hashed_counts(texts, CLASSIFIER_GRAMS)
            self.char_tfidf = FrequentTfidf([2]).fit(chars)
            features = hstack([self.vectorizer.fit_transform(texts), self.char_tfidf.transform(chars)])
            self.classifier = LinearSVC(C=SVM_C, random_state=0).fit(features, labels)
        self.detector = None  # known failure or not: cases against distractors
        is_case = [c.culprit is not None for c in self.cases]
        if len(set(is_case)) > 1:
            self.detector = self._fit_detector(is_case)

    def _fit_detector(self, is_case: list[bool]):
        """The known-failure classifier: the cases and the culprit profiles against the distractors, over the
        TF-IDF of the words (any) and of the character n-grams in 2 documents or more (each unit length) of
        the documents as pasted."""
        from scipy.sparse import vstack
        from sklearn.svm import LinearSVC

        counts = hashed_counts([as_pasted(c.text) for c in self.cases], DETECTOR_GRAMS)
        self.detector_tfidf = FrequentTfidf([1, 2]).fit(counts)
        docs = counts
        if self.profiles:
            docs = vstack([counts, hashed_counts([t for _, t in self.profiles], DETECTOR_GRAMS)]).tocsr()
        return LinearSVC(C=RELEVANCE_C, class_weight="balanced", random_state=0).fit(
            self.detector_tfidf.transform(docs), is_case + [True] * len(self.profiles))

    def match(self, text: str) -> Match:
        from scipy.sparse import hstack

        if self.classifier is None:
            return Match([], {})
        chars = self.char_tfidf.transform(hashed_counts([text], CLASSIFIER_GRAMS))
        scores = self.classifier.decision_function(hstack([self.vectorizer.transform([text]), chars]).tocsr())[0]
        ranked = sorted(((None if k == NONE else str(k), float(v)) for k, v in zip(self.classifier.classes_, scores)),
                        key=lambda kv: -kv[1])
        relevance = 1.0  # no distractors to tell known failures from: every input is one
        if self.detector is not None:
            relevance = float(self.detector.decision_function(
                self.detector_tfidf.transform(hashed_counts([text], DETECTOR_GRAMS)))[0]) - RELEVANCE_THRESHOLD
        closest: dict[str, list[tuple[Case, float]]] = {}
        known = [w for w in tokens(text) if w in self.idf]
        if known:
            bm = self.bm25.get_scores(known)
            for i in sorted(range(len(self.cases)), key=lambda i: -bm[i]):
                c = self.cases[i]
                if c.culprit and bm[i] > 0 and len(closest.setdefault(c.culprit, [])) < SEEN:
                    closest[c.culprit].append((c, float(bm[i])))
        return Match(ranked, closest, relevance)

    def evidence_lines(self, lines: list[tuple[str, str]], culprit: str, near: list[tuple[Case, float]],
                       n: int = 3) -> list[Evidence]:
        """The input lines (where, text) sharing the most rare words with the culprit's closest cases and profile."""
        words = set().union(*(self.doc_words[c.id] for c, _ in near))
        words |= {w for k, text in self.profiles if k == culprit for w in tokens(text)}
        scored = []
        for where, text in lines:
            shared = set(tokens(text)) & words
            score = sum(self.idf.get(w, 1.0) for w in shared)
            if score > 0:
                scored.append((score, where, text))
        scored.sort(key=lambda t: -t[0])
        return [Evidence(where, text.strip()[:300]) for _, where, text in scored[:n]]


_ERRORISH = re.compile(r"(?i)error|exception|fail|\bnan\b|timeout|hang|illegal|killed|traceback")
# A log record's head: a date and time, or a `[date time]` / `(pid=...)` prefix, as loggers write them.
_LOG_HEAD = re.compile(r"^\s*(?:\[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d|\(\w+ pid=|\[\w+ pid=|I\d{4} |W\d{4} |E\d{4} )")


_PROSE_START = re.compile(r"^[\-*>#\s]*[A-Za-z`'\"]")
_PROSE_WORD = re.compile(r"(?<![\w./=-])[A-Za-z][a-z]+(?:'[a-z]+)?(?![\w/=(-])")  # a word as a person writes it


def is_prose(line: str) -> bool:
    """A person's sentence: it starts with a letter (after list or quote marks) and holds four words; not
    a log record, a command line or a traceback's frame line."""
    return (bool(_PROSE_START.match(line)) and len(_PROSE_WORD.findall(line)) >= 4 and not _LOG_HEAD.match(line)
            and not _COMMAND.match(line) and not line.startswith('File "'))


# The words a person uses to say something is wrong. A sentence without one (a log's "Starting evaluation of
# ...") describes no symptom. Checked against the knowledge base: every case's report holds one.
_TROUBLE = re.compile(
    r"(?i)\b(?:not|no|never|cannot|can't|doesn't|don't|didn't|isn't|won't|instead|only|always|still|silently|same|"
    r"identical\w*|fail\w*|wrong|incorrect|bad|broken|breaks?|bug|crash\w*|hang\w*|stuck|freez\w*|garbage|"
    r"gibberish|garbled|degenerate\w*|random|nan|inf|mismatch\w*|differ\w*|diverg\w*|drops?|dropped|spikes?|"
    r"explod\w*|collaps\w*|degrad\w*|worse|slow\w*|high|higher|low|lower|smaller|larger|huge|zero|unstable|"
    r"instability|oom|out of memory|killed|timeout|timed out|error\w*|exception|warn\w*|unexpected\w*|missing|"
    r"invalid|illegal|stale|corrupt\w*|problem|issue|odd|strange|weird|jumps?|increas\w*|decreas\w*|"
    r"incompatib\w*|unsupported|deadlock\w*|leak\w*|repeat\w*|truncat\w*|overflow\w*|too long|too large|"
    r"too many|exceeds?|exceeded|rejects?|rejected|revert\w*|limit\w*)\b")


_COMMAND = re.compile(r"^\s*(?:python3?|torchrun|ray|bash|sh|srun|sbatch|deepspeed|accelerate|export|pip|cd"
                      r"|vllm serve)\b")


def query_lines(corpus) -> tuple[list[tuple[str, str]], bool]:
    """(where, text) of the lines worth matching, error lines first, then prose and config, capped;
    and whether any is an error or a person's words saying something is wrong: a clean log alone describes
    no symptom, so the knowledge base names nothing for it (it still lists known cases of what a rule found)."""
    errors, prose, rest = [], [], []
    for log in corpus.logs:
        for i, line in enumerate(log.lines):
            s = line.strip()
            if len(s) < 4 or s.startswith("```"):
                continue
            if _ERRORISH.search(s) and not re.search(r"\| PASS \||\b0 FAIL\b|\bno (?:error|failure)s?\b", s):
                errors.append((log.where(i), s))
            elif log.kind != "miles-train" and is_prose(s):
                prose.append((log.where(i), s))
            else:
                rest.append((log.where(i), s))
    for path, cfg in corpus.configs:
        rest.extend((str(path), f"{k}={v}") for k, v in flatten(cfg) if v not in (False, None, "", []))  # set ones
    return (errors + prose + rest)[:MAX_QUERY_LINES], bool(errors) or any(_TROUBLE.search(t) for _, t in prose)


def query_of(text: str, facts) -> str:
    """What the knowledge base matches: the query lines' TEXT and the FACTS read from it, as words."""
    return text + "\n" + " ".join(facts.terms())


@functools.lru_cache(maxsize=4096)
def as_pasted(text: str) -> str:
    """The query `consult` builds from TEXT pasted into a file (a report.md), read in memory (cached: the
    leave-one-out evaluation builds an index per case over the same documents)."""
    from pathlib import Path

    from miles.debug.doctor.facts import read_facts
    from miles.debug.doctor.readers import Corpus, _decode, text_log

    log = text_log(Path("report.md"), _decode(text.encode()))
    lines = "\n".join(t for _, t in query_lines(Corpus(logs=[log]))[0])
    return query_of(lines, read_facts(lines))


def seen_before(near: list[tuple[Case, float]]) -> list[dict]:
    return [{"url": c.url, "framework": c.framework, "title": c.title, "culprit": c.culprit_detail,
             "score": round(s, 2)} for c, s in near]


def finding_from(index: CaseIndex, m: Match, lines: list[tuple[str, str]]) -> Finding:
    """The knowledge base's finding: the culprit the classifier ranks first, its closest known cases."""
    culprit_id = m.top
    known, near = culprits()[culprit_id], m.closest.get(culprit_id, [])
    confidence = round(min(0.7, 0.4 + 0.3 * min(1.0, m.margin)), 2)  # below the rules' signatures
    symptom = f"like {len(near)} known failure report(s): {known.name}" if near else \
        f"the words of a known culprit: {known.name}"
    culprit, fix = known.name, known.fix
    if near:
        closest = near[0][0]
        culprit += f"; in the closest case ({closest.framework}): {closest.culprit_detail}"
        fix += f"; what fixed the closest case: {closest.fix}"
    none = next((v for k, v in m.ranked if k is None), float("-inf"))
    also = [k for k, v in [kv for kv in m.ranked if kv[0]][1:3] if v > none]  # runners-up above "none of these"
    if also:
        culprit += "; also possible: " + ", ".join(culprits()[k].short_name for k in also)
    return Finding(f"kb_{culprit_id}", symptom, confidence, index.evidence_lines(lines, culprit_id, near), culprit,
                   fix, kb=culprit_id, seen=seen_before(near), also=also)


_INDEX: CaseIndex | None = None


def default_index() -> CaseIndex:
    """The whole knowledge base: every case and every distractor (built once per process)."""
    global _INDEX
    if _INDEX is None:
        from miles.debug.doctor.knowledge import cases, distractors

        _INDEX = CaseIndex([*cases(), *distractors()])
    return _INDEX


@dataclass
class Closest:
    """The known failures nearest to an input that describes trouble but names no culprit: the ranking's first
    culprit and its closest cases, printed as pointers, not as a finding (the known-failure check said no)."""
    culprit: str  # culprit id
    cases: list[dict]  # seen_before(...)

    def to_dict(self) -> dict:
        return {"culprit_id": self.culprit, "culprit": culprits()[self.culprit].name, "cases": self.cases}


def consult(corpus, findings: list[Finding], index: CaseIndex | None = None):
    """The rules' findings with the knowledge base's word on them: known cases of the culprit a rule named
    ("seen before in"), and a finding of its own when the classifier names a culprit and no rule's
    signature (confidence >= 0.75) has named one already. Returns (findings ranked, the facts read, Closest or
    None): when the input says something is wrong and nothing was found, the closest known failures."""
    from miles.debug.doctor.facts import read_facts

    index = index or default_index()
    lines, symptomatic = query_lines(corpus)
    text = "\n".join(t for _, t in lines)
    facts = read_facts(text)
    m = index.match(query_of(text, facts))
    for f in findings:
        if f.kb in m.closest and not f.seen:
            f.seen = seen_before(m.closest[f.kb])
    sure = any(f.confidence >= 0.75 for f in findings)  # a rule's signature named it: no second opinion
    if symptomatic and not sure and m.top is not None and m.top not in {f.kb for f in findings}:
        findings = sorted([*findings, finding_from(index, m, lines)], key=lambda f: (not f.fate, -f.confidence))
    first = next(iter(m.ranked_culprits()), None)
    closest = Closest(first, seen_before(m.closest[first])) if symptomatic and not findings and \
        m.closest.get(first) else None
    return findings, facts, closest
