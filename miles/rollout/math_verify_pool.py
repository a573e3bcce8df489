"""math-verify in worker processes, each answer under a deadline: `equal(gold, pred, what=...)`.

math-verify (sympy underneath) can take unbounded time on a pathological answer
(`\\boxed{9^{9^{9^{9}}}}`), and its own signal-based timeouts only work in the main thread. So it
runs in up to four long-lived child processes (`_serve`), each request with a deadline of
VERIFY_TIMEOUT_S: a worker that misses it is killed and replaced, and the answer scores as wrong
with one warning, whichever thread asked. math-verify is imported only in the workers, so
importing this module (and the reward registry) stays cheap.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger("miles")

VERIFY_TIMEOUT_S = 5.0  # per answer, for math-verify's parse + verify; over it the answer scores as wrong


_LETTER = re.compile(r"\s*(?:\\text(?:bf)?\{)?\s*\(?([A-E])\)?\s*\}?\s*")
_E_NOTATION = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)[eE]([+-]?\d+)(?![\w.])")


def _math_verify_equal(gold: str, pred: str) -> bool:
    """math-verify's verdict on `pred` (a response, or one answer of it) against the gold answer.

    Runs in a worker (see `_serve`): the gold is parsed as one boxed answer, the prediction with
    the box first, then "final answer is", LaTeX and plain expressions; a letter gold ("B",
    "\\text{(C)}") also reads a letter after "answer". Math-verify's own signal-based timeouts are
    off: they only work in the main thread, and the worker's deadline replaces them.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, StringExtractionConfig, parse, verify

    pred_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    if letter := _LETTER.fullmatch(gold):
        gold = letter[1]
        pred = re.sub(r"\(([A-E])\)", r" \1", pred)  # "(B)" is B; math-verify wants a bare letter
        strings = StringExtractionConfig(strings=tuple("ABCDE"), try_extract_without_anchor=False, lowercase=False)
        pred_config.append(strings)
    # math-verify reads 6.02e23 as 6.02 * Euler's e * 23.
    gold, pred = (_E_NOTATION.sub(r"\1\\times10^{\2}", s.replace("\u2212", "-")) for s in (gold, pred))
    gold_parsed = parse(f"\\boxed{{{gold}}}", [LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None)
    pred_parsed = parse(pred, pred_config, parsing_timeout=None)
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _serve() -> None:
    """A worker's loop: one JSON [gold, pred, seconds] line in, one "1"/"0" line out, until EOF."""
    import resource

    out = os.fdopen(os.dup(1), "w")  # the reply channel; anything a library prints goes to stderr
    os.dup2(2, 1)
    logging.disable(logging.WARNING)  # math-verify warns that its timeouts are off: ours replace them
    _math_verify_equal("\\frac{1}{2}", "0.5")  # loads sympy and the LaTeX parser, so deadlines cover only work
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        gold, pred, seconds = json.loads(line)
        # The parent kills a worker that misses its deadline; should the parent be gone, the kernel
        # does it (SIGXCPU) once this request has used its seconds of CPU time and a second or two.
        usage = resource.getrusage(resource.RUSAGE_SELF)
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        soft = int(usage.ru_utime + usage.ru_stime + seconds) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        try:
            verdict = _math_verify_equal(gold, pred)
        except Exception:  # a parse that sympy cannot handle is a wrong answer, not a crash
            verdict = False
        out.write("1\n" if verdict else "0\n")
        out.flush()


class _Worker:
    """One child process running `_serve`; it is killed, not reused, when it misses a deadline."""

    START_TIMEOUT_S = 120.0  # importing sympy on a busy node can take a while

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # the directory that holds this `miles/`
        code = f"import sys; sys.path.insert(0, {root!r}); from miles.rollout.math_verify_pool import _serve; _serve()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buffer = b""  # read with os.read, past the pipe's own buffer, so select sees all
        try:
            while self._read_line(self.START_TIMEOUT_S) != "ready":  # skip whatever startup printed
                pass
        except (TimeoutError, EOFError) as e:
            self.kill()
            raise RuntimeError("the math-verify worker did not start (its error is above); "
                               "install it with pip install 'math-verify>=0.8'") from e

    def _read_line(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise EOFError("the math-verify worker exited")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def equal(self, gold: str, pred: str, timeout: float) -> bool:
        self.proc.stdin.write(json.dumps([gold, pred, timeout]).encode() + b"\n")
        self.proc.stdin.flush()
        return self._read_line(timeout) == "1"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


_MAX_WORKERS = min(4, os.cpu_count() or 1)
_worker_slots = threading.BoundedSemaphore(_MAX_WORKERS)  # each slot: one worker, busy or idle
_idle_workers: queue.SimpleQueue[_Worker] = queue.SimpleQueue()


def equal(gold: str, pred: str, *, what: str) -> bool:
    """math-verify's verdict within VERIFY_TIMEOUT_S; a miss (or a dead worker) is a wrong answer,
    logged once naming `what` (e.g. "sample 3")."""
    with _worker_slots:
        try:
            worker = _idle_workers.get_nowait()
        except queue.Empty:
            worker = _Worker()
        try:
            verdict = worker.equal(gold, pred, VERIFY_TIMEOUT_S)
        except (TimeoutError, EOFError, OSError) as e:
            worker.kill()
            reason = f"no verdict within {VERIFY_TIMEOUT_S:g} s" if isinstance(e, TimeoutError) else "its worker died"
            logger.warning("reward: math-verify gave %s on %s (answer of %d chars); scored 0",
                           reason, what, len(pred))
            return False
        except BaseException:  # Ctrl-C mid-answer: the worker may be stuck, do not leave it behind
            worker.kill()
            raise
        _idle_workers.put(worker)
        return verdict
