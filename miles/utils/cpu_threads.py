"""How many CPU threads torch uses, and how its idle threads wait: chosen once per process, logged.

torch's CPU kernels run on an OpenMP pool (libgomp). Left to its defaults, every core gets a
thread and a thread that finishes its share of a kernel spins for a while (GOMP_SPINCOUNT,
300,000 iterations) before it sleeps. On a quiet machine that is fastest. On a machine other
processes are using it collapses: a decode step is hundreds of small parallel regions, each
waiting at its barrier for whichever thread the kernel has just preempted, while the waiting
threads burn the CPU share the preempted one needs (32 x 64 tokens of the demo model: ~200
tok/s quiet, ~20 loaded, where vLLM, one thread bound to one core, kept ~140). So:

- `set_wait_policy()`, before torch is imported (libgomp reads the variables once, when torch
  loads it): OMP_WAIT_POLICY=PASSIVE, idle threads sleep at once, unless the user has set
  OMP_WAIT_POLICY or GOMP_SPINCOUNT. Child processes (servers, Ray workers) inherit it.
- `setup_cpu_threads(override)`, once torch is loaded: one thread per core this process may use
  (its affinity mask), whatever the load; `--cpu-threads` or OMP_NUM_THREADS win. With passive
  waiting, fewer threads than cores did not help a loaded machine: the demo rollout with 2 busy
  processes on 2 cores made 28.6 tok/s on 1 thread, 36.0 on 2 (benchmarks/cpu_engines.py, the load in
  miles' own session; in a session of its own, where the kernel shares the CPU by session, 1 thread
  and 2 made about the same loaded and 2 are faster quiet: BENCHMARKS.md, 2026-12-05). It
  logs one line with the load for the record: `CPU threads: 2 of 2 cores (load 1.9), OMP_WAIT_POLICY=PASSIVE`.
- `StepThreads`: where miles chose the count (no `--cpu-threads`, no OMP_NUM_THREADS), the local engine's CPU
  decode runs each step (and its prefill) on that many threads or fewer, whichever its own step times say is faster
  now, starting one lower for each task running elsewhere (`runnable_elsewhere`). With other
  processes in sessions of their own (the kernel then shares the CPU by session), a step of the demo rollout took
  244 ms on 1 thread against 361 ms on 2; on a quiet machine 149 ms against 113 (BENCHMARKS.md, 2026-12-06). It
  logs each change: `CPU threads: decode steps now on 1 of 2 threads (...)`.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
from collections import deque
from collections.abc import MutableMapping
from dataclasses import dataclass

logger = logging.getLogger("miles")

WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # libgomp's: read when the library loads

# What set_wait_policy did in this process: None until it ran, else a description for the log.
_wait_policy: str | None = None
# Whether setup_cpu_threads chose the thread count itself (no --cpu-threads, no OMP_NUM_THREADS): StepThreads may
# then run steps on fewer.
_chosen_by_miles = False


def wait_policy_for(environ: MutableMapping[str, str], torch_loaded: bool) -> tuple[dict[str, str], str]:
    """The variables to set and how the log line describes the wait policy. Nothing is set when
    the user set either variable (theirs are kept) or when torch, hence libgomp, is already loaded
    (too late: its threads keep spinning)."""
    given = [f"{name}={environ[name]}" for name in WAIT_VARIABLES if name in environ]
    if given:
        return {}, ", ".join(given)
    if torch_loaded:
        return {}, "OMP_WAIT_POLICY unset (torch was imported first: idle threads spin)"
    return {"OMP_WAIT_POLICY": "PASSIVE"}, "OMP_WAIT_POLICY=PASSIVE"


def set_wait_policy(environ: MutableMapping[str, str] = os.environ) -> str:
    """Sets OMP_WAIT_POLICY=PASSIVE in `environ` when the user did not choose a wait policy and torch
    is not loaded yet; returns the description the log line uses. Call it before `import torch`."""
    global _wait_policy
    changes, _wait_policy = wait_policy_for(environ, "torch" in sys.modules)
    environ.update(changes)
    return _wait_policy


def choose_threads(*, cores: int, override: int | None = None,
                   omp_num_threads: str | None = None) -> tuple[int, str | None]:
    """The intra-op thread count and, when not miles' own choice, who chose it: `override`
    (--cpu-threads), then a numeric OMP_NUM_THREADS (which torch has already applied), else one
    per core of the `cores` this process may run on."""
    if override is not None:
        return override, "--cpu-threads"
    if omp_num_threads is not None and omp_num_threads.strip().isdigit() and int(omp_num_threads) > 0:
        return int(omp_num_threads), "OMP_NUM_THREADS"
    return cores, None


@dataclass(frozen=True)
class ThreadSetup:
    threads: int
    cores: int
    load: float
    chosen_by: str | None  # "--cpu-threads", "OMP_NUM_THREADS", or None: one per core
    wait_policy: str

    def line(self) -> str:
        by = f", {self.chosen_by}" if self.chosen_by else ""
        return (f"CPU threads: {self.threads} of {self.cores} cores (load {self.load:.1f}{by}), "
                f"{self.wait_policy}")


def affinity_cores() -> int:
    """The CPUs this process may run on (its affinity mask, as taskset and cgroups set it)."""
    return len(os.sched_getaffinity(0)) if sys.platform.startswith("linux") else os.cpu_count() or 1


def setup_cpu_threads(override: int | None = None) -> ThreadSetup:
    """Sets torch's intra-op thread count (choose_threads) and logs the `CPU threads:` line."""
    import torch

    cores = affinity_cores()
    load = os.getloadavg()[0]
    threads, chosen_by = choose_threads(cores=cores,
                                        override=override, omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    torch.set_num_threads(threads)
    global _chosen_by_miles
    _chosen_by_miles = chosen_by is None
    wait = _wait_policy or wait_policy_for(os.environ, torch_loaded=True)[1]
    setup = ThreadSetup(threads=threads, cores=cores, load=load, chosen_by=chosen_by, wait_policy=wait)
    logger.info(setup.line())
    return setup


def runnable_elsewhere(samples: int = 5, interval: float = 0.01, path: str = "/proc/loadavg") -> int:
    """How many tasks besides the caller are running or waiting for a CPU now: the runnable count of /proc/loadavg
    (the numerator of its 4th field, which counts the reading thread itself) less one, the median of `samples`
    readings `interval` s apart (an instant, where the load average lags by a minute and remembers this process's
    own last run); 0 where the file is missing or unreadable."""
    import time

    counts = []
    for i in range(samples):
        try:
            with open(path) as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)
        except (OSError, IndexError, ValueError):
            return 0
        if i + 1 < samples:
            time.sleep(interval)
    return max(0, int(statistics.median(counts)))


class StepThreads:
    """The intra-op thread count of each CPU decode step, from the steps' own wall times.

    Steps run on `current` threads: at first all of them, less one for each task `busy` elsewhere when the tuner is
    made (runnable_elsewhere; at least one). Every `window` steps, 1 + PROBE steps run on a
    neighbouring count (half or double, alternately, within 1..the process's count); the first of them lets the
    kernel settle the threads on the cores and is not counted. If the median time of the other PROBE beats the
    median of the PROBE steps before the probe by MARGIN, the neighbour becomes `current` and the window starts
    again at FIRST_WINDOW; else the window doubles, up to LONGEST_WINDOW, so a steady machine pays for a probe less
    and less often. A probe whose steps ran at a row count more than ROWS_SPREAD from its reference's (rows finish
    as it runs) is dropped. The owner calls `count()` before a step and `record()` after it, and keeps the tuner
    across calls."""

    FIRST_WINDOW = 8
    LONGEST_WINDOW = 128
    PROBE = 3
    MARGIN = 0.1  # under two busy processes in a session of their own, 1 and 2 threads are within ~10%: no flips
    ROWS_SPREAD = 1.1

    def __init__(self, most: int, busy: int = 0):
        self.most = most
        self.current = max(1, most - busy)
        if self.current < most:
            logger.info("CPU threads: decode steps start on %d of %d threads (%d other tasks running)", self.current,
                        most, busy)
        self.window = self.FIRST_WINDOW
        self._since = 0  # steps on `current` since the last probe
        self._reference: deque[tuple[int, float]] = deque(maxlen=self.PROBE)  # (rows, seconds) of the last steps
        self._trial: int | None = None  # the count being probed
        self._trial_steps: list[tuple[int, float]] = []
        self._side = 0  # which neighbour the next probe tries (0: fewer threads, 1: more)
        self.changes = 0  # times `current` changed

    def count(self) -> int:
        """The thread count of the next step."""
        return self._trial or self.current

    def record(self, rows: int, seconds: float) -> None:
        """The step run on `count()` threads had `rows` rows and took `seconds`."""
        if self._trial is None:
            self._reference.append((rows, seconds))
            self._since += 1
            if self._since >= self.window and len(self._reference) == self.PROBE:
                self._trial, self._trial_steps = self._neighbour(), []
            return
        self._trial_steps.append((rows, seconds))
        if len(self._trial_steps) == 1 + self.PROBE:
            self._judge()

    def _neighbour(self) -> int | None:
        options = [n for n in (max(1, self.current // 2), min(self.most, self.current * 2)) if n != self.current]
        if not options:
            return None
        self._side ^= 1
        return options[self._side % len(options)]

    def _judge(self) -> None:
        trial, reference, tried = self._trial_steps[1:], list(self._reference), self._trial
        self._trial, self._since = None, 0
        rows = [r for r, _ in trial + reference]
        if max(rows) > self.ROWS_SPREAD * min(rows):  # rows finished meanwhile: not comparable
            return
        theirs, ours = statistics.median(s for _, s in trial), statistics.median(s for _, s in reference)
        if theirs < (1 - self.MARGIN) * ours:
            logger.info("CPU threads: decode steps now on %d of %d threads (%d steps took %.0f ms each on %d, "
                        "against %.0f ms on %d)", tried, self.most, self.PROBE, 1e3 * theirs, tried, 1e3 * ours,
                        self.current)
            self.current, self.window, self.changes = tried, self.FIRST_WINDOW, self.changes + 1
            self._reference = deque(trial, maxlen=self.PROBE)
        else:
            self.window = min(2 * self.window, self.LONGEST_WINDOW)


def step_threads_allowed() -> bool:
    """Whether the CPU decode may tune its thread count (StepThreads): miles chose the count (setup_cpu_threads with
    no --cpu-threads or OMP_NUM_THREADS), torch's deterministic algorithms are off (a run that must repeat its bits
    keeps one count: a reduction's split over threads can change its last bit), and the decode runs on the main
    thread (a rollout generated ahead on a background thread shares MKL's count with the training beside it)."""
    import threading

    import torch

    return (_chosen_by_miles and torch.get_num_threads() > 1 and not torch.are_deterministic_algorithms_enabled()
            and threading.current_thread() is threading.main_thread())
