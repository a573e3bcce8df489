"""What `miles doctor` reads: walks the given paths and turns files into a `Corpus`.

A path may be a miles run dir (`train.log`, `metrics.jsonl`, `hashes.jsonl`, `config.json`, rollout
dumps), any other log folder (a Ray session's `logs/worker-*.out|err`, `/tmp/sglang/*.log`, NCCL debug
files, wandb's `output.log`) or one file. Everything text-like is kept line by line, so a rule can
quote `file:line`; metric values are pulled into per-source series under canonical names
(`reward`, `grad_norm`, `kl`, ...) whether they came from `metrics.jsonl` or from the text of a
Miles / slime / verl / TRL / Megatron log. Binaries are skipped, huge files are read head and tail.
Only regular files are opened: a FIFO, socket or device node (a `train.log` that is a named pipe, say)
would block or never end, so it is listed as skipped instead. Beside a miles `train.log`, the run's
lock file (`.miles.lock`: pid, host, start) is read too, for `run_state`.

No torch at module level: only rollout dumps need it, and they import it when there are some.
"""

from __future__ import annotations

import json
import os
import re
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

from miles.debug.doctor.files import LOCK_NAME, not_regular, open_regular, read_lock
from miles.errors import UsageError

TEXT_SUFFIXES = {"", ".log", ".txt", ".out", ".err", ".stdout", ".stderr", ".json", ".jsonl", ".yaml", ".yml", ".md"}
# Model and checkpoint dirs hold big JSON (tokenizers) and weights: nothing a symptom shows in.
SKIP_DIRS = {".git", "__pycache__", "node_modules", "checkpoints", "tensorboard", ".ipynb_checkpoints"}
SKIP_NAMES = {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
              "generation_config.json", "added_tokens.json"}
MAX_FILES = 400  # text files per invocation; a Ray session dir can hold thousands
MAX_TOTAL_BYTES = 256 << 20  # all files together: the doctor should answer in a minute, not an hour
HEAD_BYTES, TAIL_BYTES = 4 << 20, 16 << 20  # a huge log: its start (launch, args) and its end (the crash)
MAX_DUMPS = 3  # rollout dumps are read with torch: the first two and the last are enough
MAX_DUMP_BYTES = 512 << 20

# Metric names in Miles/slime (`rollout/...`, `train/...`), verl (`actor/...`, `critic/...`), TRL
# (bare names) and Megatron (`grad norm`), under the canonical name the rules use.
ALIASES = {
    "reward": ("rollout/reward_mean", "rollout/raw_reward", "critic/score/mean", "critic/rewards/mean", "reward",
               "rewards/mean", "train/reward"),
    "grad_norm": ("train/grad_norm", "actor/grad_norm", "grad_norm", "grad norm"),
    "kl": ("rollout/kl",),  # policy vs reference, measured before any update of the step
    "kl_loss": ("train/kl_loss", "actor/kl_loss", "kl"),  # the same, as a loss term during the updates
    "logp": ("rollout/log_probs",),
    "ref_logp": ("rollout/ref_log_probs",),
    "engine_logp": ("rollout/rollout_log_probs",),
    "entropy": ("train/entropy", "actor/entropy", "entropy"),
    "logp_diff": ("forward_logp_max_diff",),
    "routing_mismatch": ("train/routing_mismatch_frac",),  # MoE: trainer's own top-k vs the engine's
}
CANONICAL = {alias: name for name, aliases in ALIASES.items() for alias in aliases}
_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+|nan|NaN|inf|Inf|Infinity)"
# A known metric name, not inside a longer one, then `:` or `=` and a number (NaN/Inf included).
_ALIAS_PAIR = re.compile(r"(?<![\w/.\-])['\"]?(?P<key>" + "|".join(re.escape(a) for a in sorted(CANONICAL, key=len,
                         reverse=True)) + r")['\"]?[ \t]*[:=][ \t]*(?:tensor\()?['\"]?(?P<val>" + _NUM + r")(?![\w.])")
_MILES_STEP = re.compile(r"\bstep (\d+)/\d+ \| (.*)")  # miles' own summary line: `step 3/10 | reward 0.5 | ...`
_STEP = re.compile(r"(?:^|[\s\[{,'\"(])(?:step|global_step|rollout|rollout_id|iteration)['\"]?\s*[:=]?\s*(\d+)\b")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_SGLANG_LOG = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?: TP\d+)?\] ")  # SGLang's own format
_MILES_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (?:INFO|WARNING|ERROR) miles \d")


@dataclass
class LogFile:
    """One text file, kept whole (`text`, for fast regex scans in C) and as `lines` (for quoting)."""

    path: Path
    text: str  # lines joined by "\n"
    numbers: list[int] | None = None  # 1-based line numbers when only head and tail were read
    kind: str = "log"  # miles-train | ray-worker | sglang | nccl | log
    lines: list[str] = field(init=False)
    starts: list[int] = field(init=False, repr=False)  # offset in `text` of each line

    def __post_init__(self):
        self.lines = self.text.split("\n")
        self.starts = [0, *accumulate(len(line) + 1 for line in self.lines[:-1])]

    def line_index(self, offset: int) -> int:
        return bisect_right(self.starts, offset) - 1

    def line_no(self, i: int) -> int:
        return self.numbers[i] if self.numbers else i + 1

    def where(self, i: int) -> str:
        return f"{self.path}:{self.line_no(i)}"


@dataclass
class Point:
    """One metric value, with where it came from (for the evidence line)."""

    step: int
    value: float
    where: str  # file:line
    text: str  # the line, or `step N key=value` for metrics.jsonl
    counted: bool = False  # the log printed no step (TRL): `step` is the value's position, not a step id


@dataclass
class MetricSource:
    name: str  # the file the values came from
    series: dict[str, list[Point]] = field(default_factory=dict)

    def add(self, canonical: str, point: Point) -> None:
        self.series.setdefault(canonical, []).append(point)


@dataclass
class DumpSummary:
    path: Path
    rollout_id: int | None
    samples: int
    rewards: list[float]
    labels_missing: int
    replacement_frac: float  # share of responses holding U+FFFD
    repetition: float  # mean share of repeated 4-grams per response
    logp_mean: float | None  # engine log-prob per response token
    responses: list[str]  # the first few, for the evidence


@dataclass
class Corpus:
    logs: list[LogFile] = field(default_factory=list)
    metrics: list[MetricSource] = field(default_factory=list)
    configs: list[tuple[Path, dict]] = field(default_factory=list)
    dumps: list[DumpSummary] = field(default_factory=list)
    hashes: list[tuple[Path, int]] = field(default_factory=list)  # (file, rows)
    # Run dir of each miles train.log -> its lock: the parsed JSON, a string saying why it is unusable,
    # or None when there is none.
    locks: dict[Path, dict | str | None] = field(default_factory=dict)
    bytes_read: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why)
    _grep_cache: dict = field(default_factory=dict, repr=False)

    def grep(self, pattern: str, flags: int = 0) -> list[tuple[LogFile, int]]:
        """(file, line index) of every log line matching `pattern`, cached (several rules share one)."""
        key = (pattern, flags)
        if key not in self._grep_cache:
            rx = re.compile(pattern, flags | re.MULTILINE)
            hits = []
            for log in self.logs:  # one scan of the whole text in C, not a Python loop over lines
                last = -1
                for m in rx.finditer(log.text):
                    i = log.line_index(m.start())
                    if i != last:
                        hits.append((log, i))
                        last = i
            self._grep_cache[key] = hits
        return self._grep_cache[key]

    def hints(self, pattern: str) -> list[str]:
        """Config entries (`key=value`) and launch/argument lines (the first 2000 of each log) that match:
        how rules learn a run's setup (MoE, colocate, async, the model name) whatever wrote it."""
        key = ("hints", pattern)
        if key not in self._grep_cache:
            rx = re.compile(pattern, re.IGNORECASE | re.MULTILINE)
            found = [f"{path}: {k}={v}" for path, cfg in self.configs for k, v in flatten(cfg)
                     if rx.search(f"{k}={v}")]
            for log in self.logs:
                head = log.text[: log.starts[min(2000, len(log.starts) - 1)]] if len(log.starts) > 2000 else log.text
                for i in dict.fromkeys(log.line_index(m.start()) for m in rx.finditer(head)):
                    found.append(f"{log.where(i)}: {log.lines[i].strip()[:300]}")
            self._grep_cache[key] = found
        return self._grep_cache[key]

    def read_list(self) -> list[str]:
        out = [f"{log.path} ({log.kind}, {len(log.lines)} lines{', head and tail only' if log.numbers else ''})"
               for log in self.logs]
        out += [f"{m.name} (metrics: {', '.join(sorted(m.series))})" for m in self.metrics
                if not any(m.name == str(log.path) for log in self.logs)]
        out += [f"{p} (config)" for p, _ in self.configs]
        out += [f"{d.path} (rollout dump, {d.samples} samples)" for d in self.dumps]
        out += [f"{p} (hashes, {n} rows)" for p, n in self.hashes]
        out += [f"{d / LOCK_NAME} (run lock{': ' + lock if isinstance(lock, str) else ''})"
                for d, lock in self.locks.items() if lock is not None]
        return out


def collect(paths: list[str]) -> Corpus:
    corpus = Corpus()
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise UsageError(f"{raw}: no such file or directory")
        files += _walk(path, corpus) if path.is_dir() else [path]
    dumps: list[Path] = []
    for path in dict.fromkeys(files):  # keep order, drop duplicates
        why = not_regular(path)
        if why:
            corpus.skipped.append((str(path), why))
        elif path.suffix == ".pt":
            dumps.append(path)
        elif len(corpus.logs) + len(corpus.configs) >= MAX_FILES:
            corpus.skipped.append((str(path), f"over the {MAX_FILES}-file limit"))
        elif corpus.bytes_read >= MAX_TOTAL_BYTES:
            corpus.skipped.append((str(path), f"over the {MAX_TOTAL_BYTES >> 20} MiB total read limit"))
        else:
            _read_file(path, corpus)
    _read_dumps(dumps, corpus)
    if not (corpus.logs or corpus.metrics or corpus.configs or corpus.dumps):
        why = "; ".join(f"{p}: {w}" for p, w in corpus.skipped[:3])
        raise UsageError(f"{' '.join(paths)}: no log, metrics, config or rollout dump files to read"
                         + (f" ({why})" if why else ""))
    return corpus


def _walk(root: Path, corpus: Corpus) -> list[Path]:
    found, other = [], {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath, name)
            if name in SKIP_NAMES or name.startswith("."):
                continue
            if path.suffix == ".pt" or path.suffix.lower() in TEXT_SUFFIXES or re.search(r"\.log\.\d+$", name):
                found.append(path)
            else:  # weights, images, wandb binaries: counted, so "what was read" is honest
                other[path.suffix] = other.get(path.suffix, 0) + 1
    if other:
        corpus.skipped.append((str(root), f"{sum(other.values())} file(s) of other types ({', '.join(sorted(other))})"))
    return found


def _read_file(path: Path, corpus: Corpus) -> None:
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(HEAD_BYTES)
            if b"\0" in head[:8192]:
                corpus.skipped.append((str(path), "binary"))
                return
            if head.startswith(b"# miles doctor bundle"):  # our own output quotes logs: reading it doubles them
                corpus.skipped.append((str(path), "a `miles doctor --bundle` file"))
                return
            tail, skipped_newlines = b"", 0
            if size > HEAD_BYTES + TAIL_BYTES:
                # Count the newlines in between so the tail's line numbers are still true.
                while f.tell() < size - TAIL_BYTES:
                    skipped_newlines += f.read(min(8 << 20, size - TAIL_BYTES - f.tell())).count(b"\n")
                tail = f.read()
            else:
                head += f.read()
    except OSError as e:
        corpus.skipped.append((str(path), e.strerror or type(e).__name__))
        return
    corpus.bytes_read += len(head) + len(tail)
    if path.name == "config.json" or (path.suffix == ".json" and size < (1 << 20)):
        try:
            data = json.loads(head)
            if isinstance(data, dict):
                corpus.configs.append((path, data))
                return
        except ValueError:
            pass  # not JSON after all: read it as text
    if path.suffix == ".jsonl" and _read_jsonl(path, head, corpus):
        return
    numbers = None
    text = _decode(head)
    if tail:
        head_lines = text.count("\n") + 1
        tail_text = _decode(tail).split("\n", 1)[-1]  # the first tail line is cut
        first_tail = head.count(b"\n") + skipped_newlines + 2
        numbers = list(range(1, head_lines + 1)) + list(range(first_tail, first_tail + tail_text.count("\n") + 1))
        text += "\n" + tail_text
    log = text_log(path, text, numbers)
    corpus.logs.append(log)
    if log.kind == "miles-train" and path.parent not in corpus.locks:
        corpus.locks[path.parent] = read_lock(path.parent / LOCK_NAME)
    if log.kind == "miles-train" and (path.parent / "metrics.jsonl").is_file():
        return  # the same numbers, more precise, come from metrics.jsonl
    source = _text_metrics(log)
    if source.series:
        corpus.metrics.append(source)


def text_log(path: Path, text: str, numbers: list[int] | None = None) -> LogFile:
    """A text file's log: its lines and what wrote it (a miles run, a Ray worker, SGLang, NCCL, other)."""
    log = LogFile(path, text, numbers)
    log.kind = _kind(path, log.lines)
    return log


def _decode(data: bytes) -> str:
    """Text with one line per `\n`: progress bars' `\r` become line breaks, colour codes go, and the
    final newline is dropped (so `lines` has no empty last entry)."""
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    return _ANSI.sub("", text).removesuffix("\n")


def _kind(path: Path, lines: list[str]) -> str:
    if any(_MILES_LOG.match(line) for line in lines[:20]):
        return "miles-train"
    if re.match(r"(python-core-)?worker-", path.name) or "raylet" in path.name:
        return "ray-worker"
    if "sglang" in str(path).lower() or any(_SGLANG_LOG.match(line) for line in lines[:20]):
        return "sglang"
    if "nccl" in path.name.lower() or any(" NCCL INFO " in line for line in lines[:50]):
        return "nccl"
    return "log"


def _read_jsonl(path: Path, data: bytes, corpus: Corpus) -> bool:
    """metrics.jsonl (or any JSON-lines file of per-step numbers) -> a MetricSource; hashes -> a count."""
    rows = []
    for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a half-written last line of a crashed run
        if isinstance(row, dict):
            rows.append((n, row))
    if not rows:
        return False
    if path.name == "hashes.jsonl":
        corpus.hashes.append((path, len(rows)))
        return True
    source = MetricSource(str(path))
    for k, (n, row) in enumerate(rows, 1):
        step = row.get("step", row.get("global_step", k))
        for key, raw in row.items():
            value = _number(raw)
            if key in CANONICAL and value is not None and isinstance(step, (int, float)):
                source.add(CANONICAL[key], Point(int(step), value, f"{path}:{n}", f"step {step} {key}={raw!r}"))
    if not source.series:
        return False
    corpus.metrics.append(source)
    return True


def _text_metrics(log: LogFile) -> MetricSource:
    """Metric values printed in a log's text, found by one regex scan per format over the whole file."""
    source = MetricSource(str(log.path))
    for m in _MILES_STEP.finditer(log.text):  # miles: `step 3/10 | reward 0.500 | grad_norm nan | ...`
        i = log.line_index(m.start())
        for part in m.group(2).split(" | "):
            key, _, raw = part.partition(" ")
            value = _number(raw)
            if key in CANONICAL and value is not None:
                source.add(CANONICAL[key], Point(int(m.group(1)), value, log.where(i), log.lines[i].strip()[:300]))
    counters: dict[str, int] = {}
    last, where, text, step = -1, "", "", None
    for m in _ALIAS_PAIR.finditer(log.text):  # `key: value`, `'key': value`, `key=value` (slime, verl, TRL, ...)
        value = _number(m.group("val"))
        if value is None:
            continue
        i = log.line_index(m.start())
        if i != last:  # a metrics line holds several values: look up its place and step once
            last, where, text = i, log.where(i), log.lines[i].strip()[:300]
            found = _STEP.search(log.lines[i])
            step = int(found.group(1)) if found else None
        canonical = CANONICAL[m.group("key")]
        # TRL prints dicts without a step: count them per metric instead.
        counters[canonical] = counters.get(canonical, 0) + 1
        source.add(canonical, Point(step if step is not None else counters[canonical], value, where, text,
                                    counted=step is None))
    return source


def _number(raw) -> float | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, (int, float)):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw)  # float() reads "nan", "inf", "-Infinity" as they are written
        except ValueError:
            try:
                return float(raw.strip().strip("'\""))
            except ValueError:
                return None
    return None


def _read_dumps(paths: list[Path], corpus: Corpus) -> None:
    if not paths:
        return

    def rollout_id(p: Path):
        digits = re.findall(r"\d+", p.stem)
        return (int(digits[-1]) if digits else -1, str(p))

    paths = sorted(paths, key=rollout_id)
    chosen = paths if len(paths) <= MAX_DUMPS else paths[: MAX_DUMPS - 1] + paths[-1:]
    corpus.skipped += [(str(p), f"rollout dump beyond the first {MAX_DUMPS - 1} and the last")
                       for p in paths if p not in chosen]
    from miles.bridge.rollout_dump import read_dump, samples_from_dump  # imports torch

    for path in chosen:
        if os.stat(path).st_size > MAX_DUMP_BYTES:
            corpus.skipped.append((str(path), "rollout dump too large"))
            continue
        try:
            payload = read_dump(path)
            n_per_prompt = int((payload.get("metadata") or {}).get("n_samples_per_prompt") or 1)
            samples = samples_from_dump(payload, path, n_per_prompt)
        except UsageError as e:  # read_dump's reason names the file and says "not a ... rollout dump" itself
            corpus.skipped.append((str(path), str(e).removeprefix(f"{path}: ")))
            continue
        except (ValueError, TypeError) as e:
            corpus.skipped.append((str(path), f"not a readable rollout dump: {e}"))
            continue
        log_probs = [lp for s in samples for lp in s.rollout_log_probs]
        corpus.dumps.append(DumpSummary(
            path, payload.get("rollout_id"), len(samples), [float(s.reward) for s in samples],
            sum(s.label is None for s in samples), sum("\ufffd" in s.response for s in samples) / len(samples),
            sum(_repetition(s.response_tokens) for s in samples) / len(samples),
            sum(log_probs) / len(log_probs) if log_probs else None, [s.response for s in samples[:3]]))


def _repetition(tokens: list[int], n: int = 4) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def flatten(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v

